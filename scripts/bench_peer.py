"""The peer: transformers + accelerate offloading against dsfp4 on the same model, budget, prompt and token
count (docs/BENCHMARKS.md). The obvious Python alternative a user would try.

    python scripts/bench_peer.py MODEL --gpu-mem 16G --cpu-mem 32G [--tokens 16] [--device cuda] [--out DIR]

MODEL is a converted dsfp4 model (bench_model.py's random one, or any). Its transformers form is written
once beside it (MODEL/../<name>-hf: bf16, every expert dequantized, the unquantized checkpoint's names),
then loaded with `device_map="auto"` under the same GPU and CPU budgets, the rest offloaded to disk.
Both generate greedily from the same token ids; the table gives decode tok/s side by side.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from dsfp4 import Engine, RunOptions
from dsfp4.convert.names.family import map_tensors, plain_checkpoint_names
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.model_args import ModelArgs
from dsfp4.layout.quant import PLAIN_DTYPES
from dsfp4.layout.safetensors_file import TensorInfo
from dsfp4.runtime.generate.tokenizer import ChatTokenizer
from dsfp4.runtime.models.weights import Weights
from dsfp4.runtime.plan.budget import parse_size

PROMPT = "Explain, step by step, why a model that does not fit in memory runs slowly"
SHARD = 4 << 30  # bytes per safetensors shard of the export
EXPERT_PART = {"w1": 0, "w3": 1, "w2": 2}  # the record's dequantize order
# a tiny model's few decode steps can hide under one stall of its 1-token run: the pair is timed again
TIMING_TRIES = 3


def export_hf(model: Path, out: Path) -> Path:
    """Write the converted model at `model` as an unquantized transformers checkpoint at `out` (once)."""
    if (out / "model.safetensors.index.json").is_file():
        return out
    m = Manifest.read(model)
    args: ModelArgs = m.args
    names = plain_checkpoint_names(args)
    infos = {n: TensorInfo(n, "BF16", shape, 0, 0) for n, shape in names.items()}
    mapped = map_tensors(args, infos, dict.fromkeys(names, "export"), "", include_mtp=False)
    w = Weights(model, m, torch.device("cpu"), torch.bfloat16)
    files = {layer: (model / ef.file).open("rb") for layer, ef in m.experts.items()}
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shard, size, index, n = {}, 0, {}, 0

    def flush() -> None:
        nonlocal shard, size, n
        if shard:
            n += 1
            save_file(shard, tmp / f"model-{n:05d}.safetensors")
            index.update(dict.fromkeys(shard, f"model-{n:05d}.safetensors"))
            shard, size = {}, 0

    @functools.lru_cache(maxsize=1)  # an expert's w1, w3 and w2 come one after another: read it once
    def expert(layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        files[layer].seek(m.experts[layer].offsets[e])
        return m.record.dequantize(files[layer].read(m.record.nbytes), dtype=torch.bfloat16)

    for item in mapped.items:
        if item.expert is not None:
            t = expert(int(item.ref.split(".")[1]), item.expert)[EXPERT_PART[item.ref.rsplit(".", 1)[1]]]
        elif len(item.shape) == 2 and m.tensors[item.ref].format not in PLAIN_DTYPES:
            t = w.matrix(item.ref, item.shape).dequantize(torch.bfloat16)
        else:
            t = w.plain(item.ref, item.shape)
        shard[item.sources["weight"]] = t.contiguous()
        size += t.numel() * 2
        if size >= SHARD:
            flush()
    flush()
    w.close()
    for f in files.values():
        f.close()
    cfg = json.loads((model / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "bfloat16"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (model / name).is_file():
            shutil.copy(model / name, tmp / name)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    tmp.rename(out)
    return out


def peer_decode(hf: Path, ids: list[int], tokens: int, device: str, gpu: int, cpu: int) -> tuple[dict, torch.Tensor]:
    """transformers + accelerate: load under the budgets, then time 1 token (prefill) and `tokens`: decode
    tok/s = (tokens - 1) / the difference (0 if none of TIMING_TRIES pairs gives a positive one) -> (results,
    the prompt's last logits [V] fp32). accelerate keeps room on the GPU for the largest layer it offloads:
    when one MoE layer is larger than the budget, the whole model stays on the CPU, as a user of
    device_map="auto" gets it."""
    from transformers import AutoModelForCausalLM

    memory = {"cpu": cpu} if device == "cpu" else {0: gpu, "cpu": cpu}
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        hf, dtype=torch.bfloat16, device_map="auto", max_memory=memory, offload_folder=str(hf / "offload")
    ).eval()
    load_s = time.perf_counter() - t0
    x = torch.tensor([ids], device=model.get_input_embeddings().weight.device)
    with torch.inference_mode():
        logits = model(x).logits[0, -1].float().cpu()

    def timed(n: int) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t0, out

    timed(1)  # warms up (allocations, offload hooks)
    for _ in range(TIMING_TRIES):
        ttft, (total, out) = timed(1)[0], timed(tokens)
        if total > ttft:
            break
    where = getattr(model, "hf_device_map", None) or {"": str(x.device)}  # not dispatched: one device
    return {
        "load_s": load_s,
        "ttft_s": ttft,
        "decode_tok_s": (tokens - 1) / (total - ttft) if total > ttft else 0.0,
        "token_ids": out[0, len(ids) :].tolist(),
        "placement": sorted({str(v) for v in where.values()}),
    }, logits


def dsfp4_decode(
    model: Path, ids: list[int], tokens: int, device: str, gpu_mem: str, cpu_mem: str
) -> tuple[dict, torch.Tensor]:
    options = RunOptions(device=device, gpu_mem=gpu_mem, cpu_mem=cpu_mem, max_context=len(ids) + tokens + 8)
    t0 = time.perf_counter()
    with Engine(model, options) as engine:
        load_s = time.perf_counter() - t0
        g = engine.generate(ids, max_tokens=tokens, temperature=0)
        logits = engine.logits(ids)[-1]
    return {
        "load_s": load_s,
        "ttft_s": g.stats.ttft_s,
        "decode_tok_s": g.stats.decode_tok_s,
        "token_ids": g.token_ids,
        "decode_mode": g.stats.decode_mode,
    }, logits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--gpu-mem", default="16G")
    ap.add_argument("--cpu-mem", default="32G")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = ap.parse_args(argv)
    hf = export_hf(a.model, a.model.with_name(a.model.name + "-hf"))
    ids = ChatTokenizer(a.model).encode_prompt(PROMPT, raw=True)
    gpu, cpu = parse_size(a.gpu_mem, "--gpu-mem"), parse_size(a.cpu_mem, "--cpu-mem")
    peer, peer_logits = peer_decode(hf, ids, a.tokens, a.device, gpu, cpu)
    ours, our_logits = dsfp4_decode(a.model, ids, a.tokens, a.device, a.gpu_mem, a.cpu_mem)
    res = {
        "budgets": {"gpu_mem": a.gpu_mem, "cpu_mem": a.cpu_mem},
        "prompt_tokens": len(ids),
        "tokens": a.tokens,
        "transformers_accelerate": peer,
        "dsfp4": ours,
        # the same model? (a random model's logits are nearly flat: greedy tokens can part on a near tie)
        "first_logits_cosine": F.cosine_similarity(peer_logits, our_logits, dim=0).item(),
        "first_logits_max_diff_over_std": ((peer_logits - our_logits).abs().max() / peer_logits.std()).item(),
    }
    p, d = res["transformers_accelerate"], res["dsfp4"]
    res["speedup"] = d["decode_tok_s"] / p["decode_tok_s"] if p["decode_tok_s"] else None
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench_peer.json").write_text(json.dumps(res, indent=1))
    print(f"{'':<26}{'load s':>9}{'TTFT s':>9}{'decode tok/s':>14}")
    for name, r in (("transformers + accelerate", p), ("dsfp4", d)):
        print(f"{name:<26}{r['load_s']:>9.1f}{r['ttft_s']:>9.2f}{r['decode_tok_s']:>14.2f}")
    speedup = f"{res['speedup']:.1f}x" if res["speedup"] else "n/a (the peer's decode time did not register)"
    print(
        f"dsfp4 / peer: {speedup}; same greedy tokens: {p['token_ids'] == d['token_ids']}; first logits: "
        f"cosine {res['first_logits_cosine']:.5f}, max diff {res['first_logits_max_diff_over_std']:.3f} std"
    )
    print(f"peer placement: {', '.join(p['placement'])}; dsfp4: {d['decode_mode']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
