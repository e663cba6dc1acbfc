"""`dsfp4 bench MODEL`: end-to-end speed on a fixed prompt set under one or more hardware presets, each
number beside the doctor's ceilings.

Per preset: TTFT, prefill and decode tok/s, bytes per token from each tier, hit rates (overall and per
layer), time waiting for experts against computing, peak device and process memory, and the efficiency
floor / measured. The floor of a decode token is max(SSD bytes / SSD ceiling, host->GPU bytes / PCIe
ceiling) + device bytes / HBM ceiling: the time its data movement needs at the measured ceilings, with
SSD and PCIe overlapped, the SSD at its faster ceiling (Ceilings.floor_s).
"""

from __future__ import annotations

import subprocess
import time
from importlib.resources import files
from pathlib import Path

import torch

from dsfp4.device import resolve_device
from dsfp4.kernels.kernel_paths import kernel_paths
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.plan.planner import Plan, token_bytes
from dsfp4.runtime.profile.calibration import BUILTIN_FILES, Entry, parse_jsonl
from dsfp4.tools.doctor import Ceilings

# about 250 tokens of prompt each
PROMPT_CHARS = 1200


def prompt_set(n: int) -> list[str]:
    """n fixed prompts: texts of the calibration sets (chat, code, languages, prose) in turn; a chat record
    gives its first user message."""
    folder = files("dsfp4") / "calibration"
    texts = [
        [_text(e)[:PROMPT_CHARS] for e in parse_jsonl((folder / name).read_text(encoding="utf-8"), name)]
        for name in sorted(BUILTIN_FILES)
    ]
    return [texts[i % len(texts)][(i // len(texts)) % len(texts[i % len(texts)])] for i in range(n)]


def _text(entry: Entry) -> str:
    return entry if isinstance(entry, str) else next(m["content"] for m in entry if m["role"] == "user")


def run_preset(
    model: Path,
    options: RunOptions,
    prompts: list[str],
    max_tokens: int,
    c: Ceilings,
    label: str | None = None,
    plan: Plan | None = None,
) -> dict:
    """One Engine under `options` (its preset or budgets, named `label`; `plan`: the plan made for them before the
    runs, else planned now), the prompts in turn (each its own conversation) -> results."""
    from dsfp4.runtime.engine import Engine

    t0 = time.perf_counter()
    with Engine(model, options, plan=plan) as engine:
        load_s = time.perf_counter() - t0
        plan, store = engine.plan, engine.model.experts
        backbone, record = token_bytes(store.manifest)
        prefills, decodes, layer_uses = [], [], {}
        # each prompt its own conversation: the prefill, then the answer after the cached prompt
        for p in prompts:
            engine.reset()
            prefills.append(engine.generate(p, max_tokens=1, temperature=0).stats)
            ids = engine.encode(p)
            # V4: its caches continue only where they stop
            if engine.model.reusable(len(ids) - 1) < len(ids) - 1:
                engine.reset()
                # so they stop before the last token
                engine.generate(ids[:-1], max_tokens=1, temperature=0)
            before = store.counters.layers()
            decodes.append(engine.generate(ids, max_tokens=max_tokens, temperature=0).stats)
            for layer, now in store.counters.layers().items():
                was = before.get(layer, (0, 0, 0))
                layer_uses[layer] = [
                    a + n - w for a, n, w in zip(layer_uses.get(layer, (0, 0, 0)), now, was, strict=True)
                ]
        decode_mode = engine.decode_mode
        paths = kernel_paths(engine.model.device)
    # each answer's first token comes with its prefill
    tokens = sum(x.generated_tokens - 1 for x in decodes)
    # passes: the re-fed last prompt token, then a pass per further token; one token's work each
    passes = max(sum(x.generated_tokens for x in decodes), 1)
    decode_s = sum(x.decode_s for x in decodes)
    moved = {k: sum(x.store.get(k, 0) for x in decodes) for k in decodes[0].store}
    uses = moved.get("expert_uses", 0) or 1
    # bytes a one-token pass moved from the SSD, over PCIe, and read on the device
    per_token = {
        "ssd": moved.get("ssd_bytes", 0) / passes,
        "h2d": moved.get("h2d_bytes", 0) / passes,
        "device": backbone + moved.get("expert_uses", 0) * record / passes,
    }
    floor = c.floor_s(per_token["device"], per_token["ssd"], per_token["h2d"])
    measured = decode_s / max(tokens, 1)
    layers = {str(layer): dict(zip(("uses", "device", "ram"), c, strict=True)) for layer, c in layer_uses.items()}
    prefill_s = sum(x.prefill_s for x in prefills)
    return {
        "preset": label or options.preset or "this machine",
        "gpu_budget": plan.budgets.gpu,
        "cpu_budget": plan.budgets.cpu,
        "gpu_slots": plan.gpu_slots,
        "ram_slots": plan.ram_slots,
        # of ram_slots, those sized for cold records
        "cold_slots": plan.cold_slots,
        "total_records": plan.total_records,
        "load_s": load_s,
        "decode_mode": decode_mode,
        # which kernels ran each part, and the word run prints where that is not the kernels at speed
        "kernel_paths": paths.parts,
        "kernel_word": paths.word,
        "routing": decodes[-1].routing or "the model's routers",
        "prompts": len(prompts),
        "prompt_tokens": sum(x.prompt_tokens for x in prefills),
        "decode_tokens": tokens,
        "ttft_s": sum(x.ttft_s for x in prefills) / len(prefills),
        "prefill_tok_s": sum(x.prompt_tokens for x in prefills) / prefill_s if prefill_s else 0.0,
        "decode_tok_s": 1 / measured if measured else 0.0,
        "bytes_per_token": per_token,
        "gpu_hit_rate": moved.get("gpu_hits", 0) / uses,
        "ram_hit_rate": moved.get("ram_hits", 0) / uses,
        "ssd_rate": moved.get("ssd_misses", 0) / uses,
        "stall_s_per_token": moved.get("stall_s", 0) / max(tokens, 1),
        "compute_s_per_token": max(measured - moved.get("stall_s", 0) / max(tokens, 1), 0.0),
        "floor_s_per_token": floor,
        "efficiency": floor / measured if floor and measured else None,
        "peak_gpu": max(x.peak_gpu for x in decodes),
        "peak_rss": max(x.peak_rss for x in decodes),
        "layers": layers,
    }


def commit(root: Path | None = None) -> str:
    """dsfp4's version and, when its package sits in a git checkout of its own (`root`, the folder above the package,
    being the repository's top and holding its pyproject.toml), that checkout's commit: '0.9.0' or '0.9.0+3f2a1bc'.
    A copy inside another repository, or an installed package, gives the version alone."""
    from dsfp4.version import __version__

    root = Path(__file__).resolve().parents[2] if root is None else root
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--show-toplevel", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except OSError:
        return __version__
    lines = out.stdout.split()
    if out.returncode or len(lines) != 2 or Path(lines[0]).resolve() != root.resolve():
        return __version__
    return f"{__version__}+{lines[1]}" if (root / "pyproject.toml").is_file() else __version__


def device_name(options: RunOptions) -> str:
    device = resolve_device(options.device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
