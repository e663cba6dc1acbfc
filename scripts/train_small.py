"""Train a small DeepSeek-V3 (transformers' DeepseekV3ForCausalLM) on text every machine has offline, and write it
as DeepSeek's release is written (FP8 blocks, its tokenizer and chat template, the MTP layer), so that `convert`,
`profile-hot`, `eval` and `run` treat it as they treat the release.

The model: MLA, sigmoid routing limited to the best groups, a shared expert, a dense first layer, 64 fine-grained
experts per MoE layer with 6 chosen, and one MTP module trained on the token after next (weight MTP_WEIGHT); `deep`
has twice its MoE layers. Load balance as DeepSeek-V3 keeps it without an auxiliary loss: each router's correction
bias moves by BIAS_STEP against its expert's load after every step (the small sequence-wise loss DeepSeek adds is left
out). The corpus (CORPORA, --corpus): `code`, the Python standard library's sources and those of the packages dsfp4
runs on; `docs`, another mix: the prose files installed beside those packages (Markdown, reStructuredText, text,
their metadata) with the packages' sources; both with dsfp4's calibration texts. Files whose path hashes to 0 mod
HELD_OUT go to the held-out split, whose first HELD_OUT_CHARS are written as OUT/heldout.txt. The
schedule follows the clock (--minutes) or --steps: warmup, then cosine decay to a tenth. OUT/training.json holds the
curve (train and held-out loss by step) and the corpus's sizes.

    python scripts/train_small.py OUT [--minutes 4] [--device cuda] [--size small|deep|tiny] [--corpus code|docs]
        [--steps N]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sysconfig
import time
import zlib
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dsfp4.synthetic.hf_state import release_shapes, release_values, transformers_keys
from dsfp4.synthetic.hf_v3 import write_checkpoint, write_tokenizer
from dsfp4.synthetic.shapes import v3_config

HELD_OUT = 50  # one file in this many is held out
HELD_OUT_CHARS = 400_000  # of held-out text written for `dsfp4 eval` (about 120,000 tokens)
# the packages dsfp4 runs on, whose sources join the standard library's in the corpus
CORPUS_PACKAGES = ("torch", "numpy", "triton", "click", "jinja2", "tqdm", "safetensors", "huggingface_hub", "fastapi")
# each corpus: (root, file suffixes) pairs; roots: the standard library, the CORPUS_PACKAGES' folders, and the
# site-packages folders that hold them (every installed distribution's prose files and metadata)
CORPORA = {
    "code": (("stdlib", (".py",)), ("packages", (".py",))),
    "docs": (("site", (".md", ".rst", ".txt", "METADATA")), ("packages", (".py",))),
}
# a larger prose file is data (word lists, vocabularies, logs), not text
PROSE_MAX_BYTES = 200_000
MTP_WEIGHT = 0.3  # of the MTP module's loss (DeepSeek-V3's first phase)
BIAS_STEP = 1e-3  # the routers' bias update speed (DeepSeek-V3's gamma)
SIZES: dict[str, dict] = {
    # ~40 MB in FP8: 4 MoE layers and the MTP block of 64 experts (top 6 of 8 groups' best 4), vocabulary 4,096
    "small": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=128,
        num_hidden_layers=5,
        first_k_dense_replace=1,
        num_attention_heads=4,
        n_routed_experts=64,
        n_shared_experts=1,
        num_experts_per_tok=6,
        n_group=8,
        topk_group=4,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        rope_scaling=None,
    ),
    # for the tests: seconds on a CPU
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=2,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        rope_scaling=None,
    ),
}


# ~75 MB in FP8: small's widths with twice its MoE layers (8, and the MTP block)
SIZES["deep"] = {**SIZES["small"], "num_hidden_layers": 9}


@dataclass(frozen=True)
class Knobs:
    seq: int = 512  # tokens per row, the BOS first
    batch: int = 64  # rows per step
    lr: float = 2e-3
    warmup: float = 0.05  # of the run
    weight_decay: float = 0.1
    eval_every: int = 100  # steps
    eval_rows: int = 32  # held-out rows of the curve


def corpus_roots(kind: str) -> list[Path]:
    """The folders a CORPORA root names, as this machine has them (a package it lacks adds nothing)."""
    if kind == "stdlib":
        return [Path(sysconfig.get_paths()["stdlib"])]
    packages = []
    for name in CORPUS_PACKAGES:
        spec = importlib.util.find_spec(name)
        packages += [Path(d) for d in (spec.submodule_search_locations or [])] if spec is not None else []
    if kind == "packages":
        return packages
    return sorted({p.parent for p in packages})  # "site": where they are installed


def corpus_files(name: str) -> list[tuple[Path, Path]]:
    """(root, file) of every file corpus `name` reads, in a fixed order (a standard library's site-packages apart;
    prose files over PROSE_MAX_BYTES left out)."""
    out = []
    for kind, suffixes in CORPORA[name]:
        for root in corpus_roots(kind):
            for p in sorted(root.rglob("*")):
                if not p.name.endswith(suffixes) or "site-packages" in p.relative_to(root).parts or not p.is_file():
                    continue
                if not p.name.endswith(".py") and p.stat().st_size > PROSE_MAX_BYTES:
                    continue
                out.append((root, p))
    return out


def corpus(limit_files: int | None = None, name: str = "code") -> tuple[list[str], list[str]]:
    """(train texts, held-out texts): the files of corpus `name` (CORPORA), split by path hash, and the calibration
    prompts (train). `limit_files`: the first files only."""
    train, held = [], []
    for root, p in corpus_files(name)[:limit_files]:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        key = f"{root.name}/{p.relative_to(root)}"
        (held if zlib.crc32(key.encode()) % HELD_OUT == 0 else train).append(text)
    if not held and train:  # a few files (tests) may hash none out
        held.append(train.pop())
    for f in sorted(files("dsfp4.calibration").iterdir(), key=lambda f: f.name):
        if f.name.endswith(".jsonl"):
            train += [json.dumps(json.loads(line), ensure_ascii=False) for line in f.read_text().splitlines() if line]
    return train, held


def stream(tok, texts: list[str], eos: int) -> np.ndarray:
    """The texts' tokens, each text ended by the EOS -> int32 [n]."""
    out = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out += [*enc.ids, eos]
    return np.array(out, dtype=np.int32)


def rows(data: np.ndarray, starts: np.ndarray, seq: int, bos: int) -> torch.Tensor:
    """[B, seq + 1]: the BOS, then seq text tokens from each start (one past a row's end is the MTP's last target)."""
    body = np.stack([data[s : s + seq] for s in starts])
    return torch.from_numpy(np.concatenate([np.full((len(starts), 1), bos, np.int32), body], 1)).long()


class MTP(nn.Module):
    """DeepSeek-V3's multi-token prediction module: the main model's final (normed) hidden state at i and the
    embedding of token i + 1, each normed, projected, through one decoder layer: predicts token i + 2."""

    def __init__(self, config, layer_idx: int):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

        super().__init__()
        d = config.hidden_size
        self.enorm, self.hnorm = DeepseekV3RMSNorm(d, config.rms_norm_eps), DeepseekV3RMSNorm(d, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = DeepseekV3DecoderLayer(config, layer_idx)
        self.norm = DeepseekV3RMSNorm(d, config.rms_norm_eps)

    def forward(self, model, h: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """h: [B, T, D] normed main states, next_ids: [B, T] -> logits [B, T, V] of the token after next_ids."""
        u = self.eh_proj(torch.cat([self.enorm(model.model.embed_tokens(next_ids)), self.hnorm(h)], -1))
        pos = torch.arange(u.shape[1], device=u.device)[None]
        u = self.block(u, position_embeddings=model.model.rotary_emb(u, pos), position_ids=pos)
        return model.lm_head(self.norm(u))

    def release_state(self, layer: int) -> dict[str, torch.Tensor]:
        """Its weights under the release's names (the block as layer `layer`)."""
        p = f"model.layers.{layer}."
        out = {p + k: v for k, v in self.block.state_dict().items()}
        out |= {p + "enorm.weight": self.enorm.weight, p + "hnorm.weight": self.hnorm.weight}
        return out | {p + "eh_proj.weight": self.eh_proj.weight, p + "shared_head.norm.weight": self.norm.weight}


class LoadBalance:
    """DeepSeek-V3's auxiliary-loss-free balance: counts each router's choices during a step, then moves its
    correction bias by BIAS_STEP towards the mean load."""

    def __init__(self, modules: list[nn.Module]):
        self.routers = [m for root in modules for m in root.modules() if type(m).__name__.endswith("TopkRouter")]
        self.counts = [torch.zeros(r.num_experts, device=r.weight.device) for r in self.routers]
        for r, c in zip(self.routers, self.counts, strict=True):
            r.register_forward_hook(self._counter(c))

    @staticmethod
    def _counter(counts: torch.Tensor):
        def hook(module: nn.Module, inputs: tuple, out: tuple) -> None:  # out: (logits, weights, ids [T, k])
            counts.add_(torch.bincount(out[2].flatten(), minlength=len(counts)))

        return hook

    def clear(self) -> None:
        for c in self.counts:
            c.zero_()

    @torch.no_grad()
    def step(self) -> float:
        """Update the biases -> the worst layer's max load over mean load (1 is perfect balance)."""
        worst = 0.0
        for r, c in zip(self.routers, self.counts, strict=True):
            r.e_score_correction_bias += BIAS_STEP * torch.sign(c.mean() - c)
            worst = max(worst, float(c.max() / c.mean().clamp(min=1)))
        self.clear()
        return worst


def losses(model, mtp: MTP, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(main loss, MTP loss) of batch [B, S + 1]: main predicts tokens 1..S from 0..S-1; MTP predicts 2..S."""
    x = batch[:, :-1]
    h = model.model(input_ids=x).last_hidden_state  # [B, S, D]
    logits = model.lm_head(h)
    main = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    side = mtp(model, h[:, :-1], x[:, 1:])  # [B, S - 1, V]
    return main, F.cross_entropy(side.flatten(0, 1).float(), batch[:, 2:].flatten())


def build(cfg: dict, device: torch.device, experts: str):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**transformers_keys(cfg), experts_implementation=experts)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).to(device)
    mtp = MTP(config, cfg["num_hidden_layers"]).to(device)
    mtp.apply(model._init_weights)
    return model, mtp


def main(argv: list[str] | None = None) -> None:
    from tokenizers import Tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--minutes", type=float, default=4.0, help="training time (the schedule follows the clock)")
    p.add_argument("--steps", type=int, help="train this many steps instead (the schedule follows the steps)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--corpus", choices=sorted(CORPORA), default="code", help="which texts it learns (CORPORA)")
    p.add_argument("--files", type=int, help="use only the corpus's first N files (tests)")
    p.add_argument("--batch", type=int, default=Knobs.batch)
    p.add_argument("--seq", type=int, default=Knobs.seq)
    a = p.parse_args(argv)
    knobs = Knobs(seq=a.seq, batch=a.batch)
    device = torch.device(a.device)
    cfg = v3_config({**SIZES[a.size], "max_position_embeddings": knobs.seq}, "fp8")  # the positions it learns
    train_texts, held_texts = corpus(a.files, a.corpus)
    a.out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    write_tokenizer(a.out, cfg["vocab_size"], "deepseek_v3", train_texts)  # first: the corpus is tokenized with it
    tok = Tokenizer.from_file(str(a.out / "tokenizer.json"))
    bos, eos = cfg["bos_token_id"], cfg["eos_token_id"]
    data, held = stream(tok, train_texts, eos), stream(tok, held_texts, eos)
    (a.out / "heldout.txt").write_text("\n".join(held_texts)[:HELD_OUT_CHARS], encoding="utf-8")
    print(
        f"corpus: {len(train_texts)} train / {len(held_texts)} held-out texts, {len(data):,} / {len(held):,} tokens "
        f"(vocabulary {cfg['vocab_size']}), tokenizer {time.perf_counter() - t0:.0f} s",
        flush=True,
    )

    experts = "grouped_mm" if device.type == "cuda" else "eager"
    model, mtp = build(cfg, device, experts)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    try:  # transformers' grouped experts where this torch runs them, else its loop over experts
        with amp:
            sum(losses(model, mtp, rows(data, np.arange(2), 16, bos).to(device))).backward()
    except (RuntimeError, NotImplementedError, TypeError) as e:
        print(f"experts {experts} failed ({str(e)[:200]}); using eager", flush=True)
        experts = model.config._experts_implementation = "eager"
    model.zero_grad(set_to_none=True)
    mtp.zero_grad(set_to_none=True)
    balance = LoadBalance([model, mtp])
    params = [*model.parameters(), *mtp.parameters()]
    decay = [q for q in params if q.ndim >= 2]
    rest = [q for q in params if q.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": knobs.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=knobs.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    rng = np.random.default_rng(0)
    held_starts = np.random.default_rng(1).integers(0, len(held) - knobs.seq, knobs.eval_rows)
    held_batch = rows(held, held_starts, knobs.seq, bos).to(device)
    curve, step, start = [], 0, time.perf_counter()
    budget = a.minutes * 60
    while True:
        frac = step / a.steps if a.steps else (time.perf_counter() - start) / budget  # of the run
        if frac >= 1:
            break
        warm = min(1.0, frac / knobs.warmup)
        for g in opt.param_groups:
            g["lr"] = knobs.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        batch = rows(data, rng.integers(0, len(data) - knobs.seq, knobs.batch), knobs.seq, bos).to(device)
        with amp:
            main_loss, mtp_loss = losses(model, mtp, batch)
        opt.zero_grad(set_to_none=True)
        (main_loss + MTP_WEIGHT * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        worst = balance.step()
        step += 1
        final = step >= a.steps if a.steps else time.perf_counter() - start >= budget
        if step % knobs.eval_every == 0 or step == 1 or final:
            with torch.no_grad(), amp:
                held_main, held_mtp = losses(model, mtp, held_batch)
            balance.clear()  # the held-out batch's choices move no bias
            point = {
                "step": step,
                "tokens": step * knobs.batch * knobs.seq,
                "seconds": round(time.perf_counter() - start, 1),
                "train_loss": round(main_loss.item(), 4),
                "train_mtp_loss": round(mtp_loss.item(), 4),
                "heldout_loss": round(float(held_main), 4),
                "heldout_mtp_loss": round(float(held_mtp), 4),
                "max_over_mean_load": round(worst, 2),
            }
            curve.append(point)
            print(json.dumps(point), flush=True)

    state = {k: v for k, v in model.state_dict().items()}
    state |= mtp.release_state(cfg["num_hidden_layers"])
    shapes = release_shapes(state, cfg)
    write_checkpoint(a.out, cfg, shapes, release_values(state, cfg), "fp8", n_shards=4, tokenizer=False)
    summary = {
        "size": a.size,
        "corpus": a.corpus,
        "config": {k: cfg[k] for k in SIZES[a.size]},
        "knobs": knobs.__dict__,
        "experts_implementation": experts,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "train_tokens": int(len(data)),
        "heldout_tokens": int(len(held)),
        "steps": step,
        "curve": curve,
    }
    (a.out / "training.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {a.out}: {step} steps in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
