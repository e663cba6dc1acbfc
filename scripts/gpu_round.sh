#!/usr/bin/env bash
# The measurements the CPU machine cannot make, batched for one GPU session; docs/BENCHMARKS.md takes their tables.
# Run from the repository root with the wheels the GPU image lacks in .whl/ (gguf, zstandard, llguidance, made with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 ...`), stages in order, each call under 10 min:
#
#   bash scripts/gpu_round.sh setup fp8     # the wheels, the V3-width bench model, doctor; the FP8 backbone by bits
#                                           # against the native path (issue 49): scripts/bench_fp8_by_bits.py and
#                                           # the GPU tests of that path forced by DSFP4_FP8_BY_BITS=1
#   bash scripts/gpu_round.sh setup first   # each prompt length's first request in a fresh process, twice with one
#                                           # Triton cache: a new install's and a later process's (issue 50)
#   bash scripts/gpu_round.sh setup levers  # the small DeepSeek trained (3.5 min), converted, its exact NVFP4 logits,
#                                           # then eval_levers at 8, 7 and 6 experts a token (issue 51, item 3)
#   bash scripts/gpu_round.sh verify        # the GPU tests of this round's new code: the backbone's warm-up, the forced
#                                           # by-bits path, the split across cards (one card named twice), mixed-bit
#                                           # cold records, the W4A8 prefill forced on the H200
#   bash scripts/gpu_round.sh prefill       # a resident prompt of 8k and 32k tokens in both orders, repeated, the last
#                                           # of each profiled (scripts/profile_prefill.py; issue 47's attention share)
#   bash scripts/gpu_round.sh widen         # the by-bits prefill GEMM widened for cuBLAS against the Triton W8A16 GEMM
#                                           # across token counts (the crossover), and a resident prompt layer by layer
#                                           # natively and by bits (issue 49); the by-bits GPU tests
#   bash scripts/gpu_round.sh fp8attn       # the FP8 prefill attention: its GPU tests, its kernel against the bf16 one
#                                           # at V3's shapes, and resident prompts layer by layer with and without it
#   bash scripts/gpu_round.sh simcheck      # the check of the simulation, RUNS (5) times under each of two calibrated V3
#                                           # traces (reuse mid and low) at the whole V3's 16g share, beside the
#                                           # simulation at the doctor's disk rate and at the run's (issue 51, item 4)
#   bash scripts/gpu_round.sh waves         # a streamed prefill wave's compacted calls against the per-piece calls at
#                                           # V3's expert shapes (scripts/bench_moe_waves.py), their tests on the card,
#                                           # and the warm-up's GPU test with experts streamed
#   bash scripts/gpu_round.sh train         # the small DeepSeek trained (3.5 min) and sent back in $OUT as 15 MB parts
#                                           # (ts_src.tar.*), for the quality measurements the CPU machine makes:
#                                           # cat ts_src.tar.* | tar -x -C DIR
#
# `setup` is quick where /tmp already holds its work (a warm machine); each stage writes its JSON under $OUT.
set -euo pipefail

ROOT=$(pwd)
OUT=${OUT:-$ROOT/gpu-round-out}
BM=${BM:-/tmp/bs/model} # the bench model: V3 width, 1 dense + 2 MoE layers of 256 NVFP4 experts (BM_DIMS: its
                        # config keys overridden, e.g. n_routed_experts=32 for a quick one with V3's shapes)
TS=/tmp/ts              # the trained small DeepSeek: src/ (its FP8 release), nvfp4/ (converted)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

setup() {
    if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$ROOT"/.whl/*.whl
    fi
    export PYTHONPATH=/tmp/site:$ROOT/src
    # shellcheck disable=SC2086
    [ -f "$BM/manifest.json" ] || python3 scripts/bench_model.py "$BM" --layers 3 --dense 1 --tokenizer \
        ${BM_DIMS:+--dims $BM_DIMS}
    [ -f "$OUT/doctor.json" ] || python3 -m dsfp4.cli.main doctor "$BM" --out "$OUT/doctor.json"
}

fp8() {
    python3 scripts/bench_fp8_by_bits.py "$BM" --out "$OUT/fp8_by_bits" 2>&1 | tee "$OUT/fp8_by_bits.log"
    DSFP4_FP8_BY_BITS=1 python3 -m pytest -q -m gpu tests/kernels/test_fp8_by_bits.py tests/kernels/test_fp8_linear.py \
        2>&1 | tail -5 | tee "$OUT/fp8_by_bits_tests.log"
}

first() {
    local cache=/tmp/triton-first-cache
    rm -rf "$cache"
    for run in new-install later-process; do
        python3 scripts/bench_first_request.py "$BM" --cache "$cache" --json "$OUT/first_request_$run.json" \
            --lengths "${LENGTHS:-20,100,512,2000}" \
            2>&1 | tee "$OUT/first_request_$run.log"
    done
}

levers() {
    [ -f "$TS/src/config.json" ] || python3 scripts/train_small.py "$TS/src" --minutes 3.5
    [ -f "$TS/nvfp4/manifest.json" ] || python3 -m dsfp4.cli.main convert --fp4 "$TS/src" "$TS/nvfp4" --device cuda
    # the first 6,000 characters of the held-out text, as the README's lever table used
    python3 -c "import sys; sys.stdout.write(open(sys.argv[1], encoding='utf-8').read()[:6000])" \
        "$TS/src/heldout.txt" > "$TS/h6k.txt"
    [ -f "$TS/nv6.lp" ] || python3 -m dsfp4.cli.main eval "$TS/nvfp4" --text "$TS/h6k.txt" --save-logits "$TS/nv6.lp" \
        --device cpu --dtype fp32 -q
    for k in 0 7 6; do
        python3 scripts/eval_levers.py "$TS/nvfp4" 0:0 latency --text "$TS/h6k.txt" --reference "$TS/nv6.lp" \
            --experts-per-token "$k" | tee "$OUT/levers_k$k.jsonl"
    done
}

verify() {
    # the whole log under $OUT, whichever way the call ends
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_kernel_warm_up.py tests/runtime/test_split_run.py \
        tests/runtime/test_device_split.py tests/layout/test_cold.py tests/kernels/test_moe_prefill_mma.py \
        > "$OUT/verify.log" 2>&1 || true
    tail -15 "$OUT/verify.log"
    DSFP4_FP8_BY_BITS=1 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8_by_bits.py \
        > "$OUT/verify_by_bits.log" 2>&1 || true
    tail -15 "$OUT/verify_by_bits.log"
}

prefill() {
    python3 scripts/profile_prefill.py "$BM" --tokens "${LENGTHS:-8192,32768}" --reps 3 --profile \
        --out "$OUT/profile_prefill" 2>&1 | grep -v -i warn | tee "$OUT/profile_prefill.log"
}

widen() {
    python3 scripts/bench_fp8_by_bits.py --kernels-only --gemm-tokens "${GEMM_TOKENS:-64,128,256,512,1024,4096}" \
        --out "$OUT/fp8_widen" 2>&1 | tee "$OUT/fp8_widen.log" | grep -v -i warn
    DSFP4_FP8_BY_BITS=1 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8_by_bits.py \
        > "$OUT/widen_tests.log" 2>&1 || true
    tail -3 "$OUT/widen_tests.log"
    for forced in 0 1; do
        DSFP4_FP8_BY_BITS=$forced python3 scripts/profile_prefill.py "$BM" --tokens "${LENGTHS:-8192}" --reps 2 \
            --orders layer --out "$OUT/widen_prefill_$forced" 2>&1 | grep '^{' | tee "$OUT/widen_prefill_$forced.log"
    done
}

fp8attn() {
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_mla_prefill.py tests/kernels/test_mla_prefill_fp8.py \
        tests/kernels/test_e4m3_rows_kernel.py \
        tests/runtime/test_fp8_attention.py \
        > "$OUT/fp8attn_tests.log" 2>&1 || true
    tail -3 "$OUT/fp8attn_tests.log"
    python3 scripts/bench_prefill_attention.py --tokens 4096 --context 4096,28672 --reps 3 --out "$OUT" 2>&1 \
        | grep -v -i warn | tee "$OUT/fp8attn_kernel.log"
    for fp8 in "" --fp8-attention; do
        python3 scripts/profile_prefill.py "$BM" --tokens "${LENGTHS:-8192,32768}" --reps 2 --orders layer $fp8 \
            --out "$OUT/fp8attn_prefill${fp8:+_fp8}" 2>&1 | grep '^{' | tee -a "$OUT/fp8attn_prefill.log"
    done
}

simcheck() {
    local reuse traces=()
    for reuse in mid low; do
        [ -f "/tmp/v3_$reuse.npy" ] || python3 scripts/synthetic_trace.py "/tmp/v3_$reuse.npy" --model v3 --reuse "$reuse" \
            --tokens 2048 > /dev/null
        traces+=(--routing "/tmp/v3_$reuse.npy")
    done
    python3 scripts/bench_sim_check.py "$BM" "${traces[@]}" --ceilings "$OUT/doctor.json" --runs "${RUNS:-5}" \
        --json "$OUT/sim_check.json" 2>&1 | grep -v -i warn | tee "$OUT/sim_check.log"
}

waves() {
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_waves.py tests/runtime/test_kernel_warm_up.py \
        tests/runtime/test_split_run.py \
        > "$OUT/waves_tests.log" 2>&1 || true
    tail -3 "$OUT/waves_tests.log"
    python3 scripts/bench_moe_waves.py --out "$OUT" 2>&1 | grep -v -i warn | tee "$OUT/moe_waves.log"
}

train() {
    export PYTHONPATH=${PYTHONPATH:-$ROOT/src}
    [ -f "$TS/src/config.json" ] || python3 scripts/train_small.py "$TS/src" --minutes 3.5 2>&1 | tail -5
    tar -cf - -C "$TS" src | split -b 15M - "$OUT/ts_src.tar."
}

for stage in "$@"; do
    case "$stage" in
        setup | fp8 | first | levers | verify | prefill | widen | fp8attn | simcheck | waves | train) "$stage" ;;
        *) echo "unknown stage $stage: give setup, fp8, first, levers, verify, prefill, widen, fp8attn, simcheck," \
               "waves or train" >&2
           exit 2 ;;
    esac
done
