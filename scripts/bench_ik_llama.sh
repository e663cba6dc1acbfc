#!/usr/bin/env bash
# ik_llama.cpp beside dsfp4 on the GPU machine (issue 51, item 1; docs/ik_llama.md): ik built from
# .whl/ik_llama.tar.gz (scripts/ik_llama_subset.sh makes it from a clone of ikawrakow/ik_llama.cpp; checked at 8337e4c),
# the V3-width bench model of runs 42A-42B (one expert group here: ik ignores the groups) and its GGUF, then
# scripts/bench_llamacpp.py --peer ik. .whl also holds the gguf and zstandard wheels the machine's image lacks. Run
# from the repository root, .whl carried, stages in order (each call <10 min):
#
#   bash scripts/bench_ik_llama.sh prep           # unpack, configure, build (ninja capped at BUILD_S, 480 s here; a rerun resumes)
#                                      # while the bench model (16 GB) and its GGUF are written in the background
#   bash scripts/bench_ik_llama.sh build check    # the rest of the build; greedy tokens ik (CUDA) vs dsfp4 on a small model
#   bash scripts/bench_ik_llama.sh bench          # ik's four placements + the SSD-bound pair at V3's 16g share, beside dsfp4:
#                                      # both at MXFP4, the same 4.25 bits per routed weight
#   bash scripts/bench_ik_llama.sh quant q3_K 3   # the experts requantized by ik's llama-quantize to q3_K (3.44 bpw) against dsfp4
#                                      # with 3-bit cold records (3.25 bpw with MXFP4's scales) at the same RAM bytes
#   bash scripts/bench_ik_llama.sh quant q2_K 2   # the same at 2 bits: q2_K (2.63 bpw) against 2-bit cold records (2.25)
#   bash scripts/bench_ik_llama.sh table          # every row so far
# quant TYPE alone (no bits) pairs ik's TYPE with exact dsfp4; nearer bytes than q3_K/q2_K: iq3_ks (3.19), iq2_ks (2.19)
# (ik's own non-linear types, slower to quantize). Only one requantized GGUF is kept at a time (64 GiB disk).
#
# Every stage ends with the table. Rows and logs stay in /tmp/ik/out; $OUT gets the JSON and ik_out.tgz (all of it).
# Knobs (environment): BUILD_S (540 s; prep 480), TOKENS (32), REPS (2), PROMPT (64), HOT_SHARE (0.1, cold stages).
set -euo pipefail

ROOT=$(pwd)
IK=/tmp/ik
SRC=$IK/ik_llama.cpp
B=$IK/build
RES=$IK/out
BM=/tmp/bm            # the bench model: V3 width, 1 dense + 2 MoE layers of 256 MXFP4 experts, random router
BX=/tmp/bx            # the small model of the greedy check (V3's MLA sizes, 512 wide, 16 experts)
# ik's DeepSeek graph routes by plain top-k and ignores the expert groups (n_group 8, topk_group 4 in V3's config):
# one group, so that both engines route alike
ONE_GROUP="n_group=1 topk_group=1"
TOKENS=${TOKENS:-32}
REPS=${REPS:-2}
PROMPT=${PROMPT:-64}
mkdir -p "$IK" "$RES"
# what came so far goes back, whichever way the call ends
trap '[ -n "${OUT:-}" ] && { cp "$RES"/*.json "$OUT"/ 2>/dev/null; tar -czf "$OUT/ik_out.tgz" -C "$RES" .; }; true' EXIT

setup_python() {
    # gguf (the export's writer) and zstandard are not in the machine's image
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$ROOT"/.whl/gguf-*.whl "$ROOT"/.whl/zstandard-*.whl
    export PYTHONPATH=/tmp/site:$ROOT PYTHONUNBUFFERED=1
}

configure() {
    [ -d "$SRC" ] || tar -xzf "$ROOT/.whl/ik_llama.tar.gz" -C "$IK"
    [ -f "$B/build.ninja" ] && return
    # NCCL off: one GPU, and the image's pip NCCL need not be found the same way twice; the server needs web assets
    # the subset leaves out; IQK_FA_ALL_QUANTS off: CPU flash attention for f16/q8_0 KV only (llama-bench's f16)
    cmake -S "$SRC" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DGGML_NATIVE=ON -DGGML_NCCL=OFF -DGGML_IQK_FA_ALL_QUANTS=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF 2>&1 | tee "$RES/configure.log" | tail -3
}

build() {
    configure
    [ -x "$B/bin/llama-bench" ] && [ -x "$B/bin/llama-quantize" ] && return
    local t0=$SECONDS rc=0
    # SIGINT: ninja stops its compilers and keeps what finished; a rerun resumes
    timeout -s INT "${BUILD_S:-540}" ninja -C "$B" -j16 llama-bench llama-quantize > "$RES/build.log" 2>&1 || rc=$?
    echo "ik build: rc $rc after $((SECONDS - t0)) s ($(grep -o '^\[[0-9]*/[0-9]*\]' "$RES/build.log" | tail -1))"
    if [ $rc -ne 0 ]; then
        tail -5 "$RES/build.log"
        echo "ik build not finished: run 'bash scripts/bench_ik_llama.sh build ...' again (ninja resumes)"
        return 3
    fi
}

bounded() {  # a command, stopped at $DEADLINE (the script's seconds) where one is set
    if [ -n "${DEADLINE:-}" ]; then
        timeout "$((DEADLINE > SECONDS ? DEADLINE - SECONDS : 1))" "$@"
    else
        "$@"
    fi
}

write_model() {  # DIR DIMS...: a bench model (the writer wants an empty folder: a partial one is written again)
    local dir=$1
    shift
    [ -f "$dir/manifest.json" ] && return
    rm -rf "$dir"
    bounded python3 scripts/bench_model.py "$dir" --layers 3 --dense 1 --experts mxfp4 --tokenizer --dims "$@"
}

model() {
    setup_python
    write_model "$BM" n_routed_experts=256 $ONE_GROUP
    # the export resumes after its last whole tensor
    [ -f "$BM-g/model.gguf" ] || bounded python3 -m dsfp4.cli.main export "$BM" "$BM-g" --format gguf
    write_model "$BX" hidden_size=512 moe_intermediate_size=256 n_routed_experts=16 intermediate_size=1024 \
        num_attention_heads=8 $ONE_GROUP
    [ -f "$BX-g/model.gguf" ] || bounded python3 -m dsfp4.cli.main export "$BX" "$BX-g" --format gguf
}

prep() {
    # the writer stops by 570 s, so that the call ends inside its 600 s; whatever it left is finished next time
    (
        set +e
        DEADLINE=$((SECONDS + 570)) model > "$RES/model.log" 2>&1
        echo "model rc $?" >> "$RES/model.log"
    ) &
    local writer=$! rc=0
    BUILD_S=${BUILD_S:-480} build || rc=$?
    wait $writer
    tail -4 "$RES/model.log"
    grep -q "model rc 0" "$RES/model.log" || rc=5
    return $rc
}

check() {
    setup_python
    local p
    for p in "The expert store keeps the hottest records" "Once upon a time" "def main():"; do
        python3 scripts/bench_llamacpp.py check "$BX" "$BX-g/model.gguf" --llama-cpp "$B" --llama-src "$SRC" \
            --peer ik --tokens 24 --gpu-layers 99 --prompt "$p" 2>&1 | tee -a "$RES/check.log"
    done
}

exact_model() {
    # a cold stage narrowed the bench model in place: write the exact one again (same seed, same weights)
    [ -f "$BM/.cold-bits" ] && rm -rf "$BM"
    write_model "$BM" n_routed_experts=256 $ONE_GROUP
}

bench() {
    model
    exact_model
    python3 scripts/bench_llamacpp.py bench "$BM" "$BM-g/model.gguf" --llama-cpp "$B" --peer ik --share 16g \
        --prompt-tokens "$PROMPT" --tokens "$TOKENS" --reps "$REPS" --json "$RES/bench_mxfp4.json" 2>&1 \
        | tee "$RES/bench_mxfp4.log"
}

quant() {
    local type=$1 bits=${2:-}
    model
    local q="$BM-g/experts-$type.gguf"
    # one requantized GGUF at a time: the disk holds the model, its GGUF and one more
    find "$BM-g" -name 'experts-*.gguf*' ! -name "experts-$type.gguf" -delete
    if [ ! -f "$q" ]; then
        local t0=$SECONDS
        # the experts only; the backbone stays as exported (Q8_0 copied, BF16 tables and F16 k_b/v_b kept); written
        # under .partial, so that a call cut short leaves nothing a rerun would take for whole
        "$B/bin/llama-quantize" --allow-requantize --token-embedding-type bf16 --output-tensor-type bf16 \
            --custom-q "ffn_(gate|up|down)_exps=$type,attn_k_b=f16,attn_v_b=f16" "$BM-g/model.gguf" "$q.partial" \
            Q8_0 16 > "$RES/quantize-$type.log" 2>&1 || { tail -20 "$RES/quantize-$type.log"; return 4; }
        mv "$q.partial" "$q"
        echo "llama-quantize $type: $((SECONDS - t0)) s"
        grep -E "model size|quant size" "$RES/quantize-$type.log" || true
    fi
    if [ -z "$bits" ]; then
        exact_model
    elif [ "$(cat "$BM/.cold-bits" 2>/dev/null)" != "$bits" ]; then
        exact_model
        # marked before narrowing: a stage cut short leaves a model that exact_model writes again
        echo partial > "$BM/.cold-bits"
        python3 -m dsfp4.cli.main profile-hot "$BM" --repack --cold-bits "$bits" --hot-share "${HOT_SHARE:-0.1}"
        echo "$bits" > "$BM/.cold-bits"
    fi
    python3 scripts/bench_llamacpp.py bench "$BM" "$q" --llama-cpp "$B" --peer ik --placement exps-cpu --share 16g \
        --prompt-tokens "$PROMPT" --tokens "$TOKENS" --reps "$REPS" --json "$RES/bench_$type${bits:+_cold$bits}.json" \
        2>&1 | tee "$RES/bench_$type.log"
}

table() {
    python3 - "$RES" <<'EOF'
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("bench_*.json")):
    rows = json.loads(f.read_text())
    print(f"\n{f.name}")
    print(f"{'engine':<13}{'placement':<60}{'kind':<9}{'tok/s':>9}{'GB/token':>10}{'GB/s':>7}")
    for r in rows:
        gb = r.get("disk_gb_per_token", r.get("ssd_gb_per_token_of_both"))
        rate = r.get("disk_gb_s", r.get("ssd_read_gb_s"))
        print(f"{r['engine']:<13}{r['placement'][:59]:<60}{r['kind']:<9}{r['tok_s']:>9.2f}"
              f"{'' if gb is None else f'{gb:.3f}':>10}{'' if rate is None else f'{rate:.2f}':>7}")
    capped = {r["kind"]: r["tok_s"] for r in rows if r["placement"].endswith("RAM capped")}
    ours = {r["kind"]: r["tok_s"] for r in rows if r["engine"] == "dsfp4"}
    for kind in ("decode", "prefill"):
        if capped.get(kind) and ours.get(kind):
            print(f"  SSD-bound pair, {kind}: dsfp4 / ik_llama.cpp = {ours[kind] / capped[kind]:.2f}x")
print("\nGB/token, GB/s: ik's disk reads over that kind's timed runs (/sys/block); dsfp4's store over the prompt and"
      " the decode together (its SSD reads per token of both)")
EOF
}

[ $# -gt 0 ] || { sed -n 2,20p "$0"; exit 2; }
while [ $# -gt 0 ]; do
    case $1 in
        prep | build | model | check | bench) "$1" ;;
        quant) quant "${@:2}"; break ;;  # quant takes the rest: TYPE [COLD_BITS]
        table) ;;
        *) echo "unknown stage $1 (prep build model check bench quant table)"; exit 2 ;;
    esac
    shift
done
table
