"""`dsfp4 eval`: perplexity of a model over a text, and its distance from a reference's log-probabilities.

The contract (docs/eval.md): the text is tokenized once without special tokens; each window is the BOS (where the
tokenizer's add_bos_token says so) followed by `context` - 1 text tokens (`context` without a BOS); windows start
`stride` text tokens apart (default `context` - 1: no overlap after a BOS); a tail shorter than a window is dropped;
every text token of a window that no earlier window scored is scored, except a window's first text token when no
BOS comes before it (nothing predicts it). Each window is prefilled from position 0 by Engine.logits, the path
`dsfp4 run` prefills a prompt with (same kernels, store and budgets).

Against a reference (`--reference`, written by `--save-logits` with the same text and windows): the KL divergence
KL(reference || model) per position over the reference's k best tokens plus one bucket for the rest of the
vocabulary (exact when the rest holds no mass; otherwise a lower bound of the full KL, by coarse-graining), its mean
and 99th percentile, the share of positions whose most likely token agrees, and the ratio of perplexities.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dsfp4.errors import ConfigError
from dsfp4.tools.logprobs_file import LogProbs

# probability mass below this outside the kept tokens is rounding (fp32 sums), taken as none
REST_FLOOR = 1e-6


@dataclass(frozen=True)
class Window:
    # its first text token
    start: int
    # the first text token it scores (later than start where an earlier window scored those)
    first: int
    # one past its last text token
    end: int


def windows(n_text: int, context: int, stride: int | None, bos: bool) -> list[Window]:
    """The windows over a text of n_text tokens (the contract above); stride None: context - 1 (without a BOS the
    windows then overlap by the one token nothing in its own window predicts)."""
    body = context - int(bos)
    stride = context - 1 if stride is None else stride
    if context < 2:
        raise ConfigError(f"--context {context}: a window needs at least 2 tokens")
    if not 1 <= stride <= context - 1:
        raise ConfigError(f"--stride {stride}: give 1 to {context - 1} (--context - 1), so no text token is skipped")
    out, scored_to = [], 0
    for start in range(0, n_text - body + 1, stride):
        first = max(start + int(not bos), scored_to)
        out.append(Window(start, first, start + body))
        scored_to = start + body
    return out


def scored_targets(ids: list[int], wins: list[Window]) -> np.ndarray:
    """[N] int32: the text tokens the windows score, in order."""
    return np.array([t for w in wins for t in ids[w.first : w.end]], dtype=np.int32)


@dataclass
class Evaluation:
    """What `dsfp4 eval` prints (`to_dict`), and the log-probabilities it may save."""

    # positions scored
    tokens: int
    windows: int
    context: int
    stride: int
    nll_mean: float
    seconds: float
    logprobs: LogProbs
    kl: np.ndarray | None = None  # [N] per position, against the reference
    top1_agreement: float | None = None
    reference_nll_mean: float | None = None

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_mean)

    def to_dict(self) -> dict:
        out = {
            "perplexity": self.perplexity,
            "nll_mean": self.nll_mean,
            "tokens": self.tokens,
            "windows": self.windows,
            "context": self.context,
            "stride": self.stride,
            "seconds": self.seconds,
            "tok_s": self.tokens / self.seconds if self.seconds else 0.0,
        }
        if self.kl is not None:
            ref_ppl = math.exp(self.reference_nll_mean)
            out |= {
                "kl_mean": float(self.kl.mean()),
                "kl_p99": float(np.percentile(self.kl, 99)),
                "kl_max": float(self.kl.max()),
                "top1_agreement": self.top1_agreement,
                "reference_perplexity": ref_ppl,
                "perplexity_ratio": self.perplexity / ref_ppl,
            }
        return out


def header(vocab_size: int, context: int, stride: int, bos: bool, model: str) -> dict:
    """What a saved reference records about its windows (checked by check_reference)."""
    return {"vocab_size": vocab_size, "context": context, "stride": stride, "bos": bos, "model": model}


def check_reference(path: str, ref_header: dict, ref: LogProbs, ours: dict, targets: np.ndarray) -> None:
    """A reference must score the same positions of the same tokens: same vocabulary, windows and text."""
    if ref_header.get("vocab_size") != ours["vocab_size"]:
        raise ConfigError(
            f"--reference {path}: a vocabulary of {ref_header.get('vocab_size')} tokens, this model's has "
            f"{ours['vocab_size']}: compare models that share a tokenizer"
        )
    for key in ("context", "stride", "bos"):
        if ref_header.get(key) != ours[key]:
            flag = {"context": "--context", "stride": "--stride", "bos": "the tokenizer's add_bos_token"}[key]
            raise ConfigError(
                f"--reference {path}: written with {key} {ref_header.get(key)}, this run has {ours[key]}: give the "
                f"same {flag}"
            )
    if len(ref.targets) != len(targets) or not np.array_equal(ref.targets, targets):
        raise ConfigError(
            f"--reference {path}: it scored other tokens ({len(ref.targets)} positions, this text gives "
            f"{len(targets)}): another text or another tokenizer"
        )


def _bucket_kl(ref_ids: torch.Tensor, ref_lp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(reference || model) [n] over the reference's top ids [n, k] and the rest as one bucket; logp: [n, V]."""
    p_lp, q_lp = ref_lp.double(), logp.gather(1, ref_ids.long()).double()  # [n, k]
    top = (p_lp.exp() * (p_lp - q_lp)).sum(1)
    p_rest = 1 - p_lp.exp().sum(1)
    q_rest = (1 - q_lp.exp().sum(1)).clamp(min=REST_FLOOR)
    # below it, the rest is fp32 rounding of a sum of probabilities, not mass
    has_rest = p_rest > REST_FLOOR
    rest = torch.where(has_rest, p_rest * (p_rest.clamp(min=REST_FLOOR).log() - q_rest.log()), 0.0)
    return top + rest


def evaluate(
    logits_of: Callable[[list[int]], torch.Tensor],
    ids: list[int],
    wins: list[Window],
    bos_id: int | None,
    context: int,
    stride: int,
    top_k: int,
    reference: LogProbs | None = None,
    on_window: Callable[[int, int], None] | None = None,
) -> Evaluation:
    """Score the windows over the text `ids` with `logits_of` (token ids -> logits [T, V] after each, from position
    0) -> the evaluation; `reference` aligned with the windows' scored positions."""
    t0 = time.perf_counter()
    nll = 0.0
    parts: dict[str, list] = {"targets": [], "target_logprob": [], "top_ids": [], "top_logprob": []}
    kls, agree, done = [], 0, 0
    for i, w in enumerate(wins):
        head = [bos_id] if bos_id is not None else []
        tokens = head + ids[w.start : w.end]
        logits = logits_of(tokens)  # [T, V]
        # the rows predicting scored tokens
        rows = torch.arange(w.first - w.start, w.end - w.start) + len(head) - 1
        logp = torch.log_softmax(logits[rows].float(), dim=-1)  # [n, V]
        target = torch.tensor(ids[w.first : w.end], dtype=torch.long)
        got = logp.gather(1, target[:, None])[:, 0]  # [n]
        top_lp, top_ids = logp.topk(min(top_k, logp.shape[1]), dim=-1)  # [n, k]
        nll -= float(got.double().sum())
        parts["targets"].append(target.int().numpy())
        parts["target_logprob"].append(got.numpy())
        parts["top_ids"].append(top_ids.int().numpy())
        parts["top_logprob"].append(top_lp.numpy())
        if reference is not None:
            n = len(target)
            ref_ids = torch.from_numpy(reference.top_ids[done : done + n])
            kls.append(_bucket_kl(ref_ids, torch.from_numpy(reference.top_logprob[done : done + n]), logp).numpy())
            agree += int((top_ids[:, 0] == ref_ids[:, 0]).sum())
        done += len(target)
        if on_window is not None:
            on_window(i + 1, len(wins))
    lp = LogProbs(**{k: np.concatenate(v) for k, v in parts.items()})
    out = Evaluation(done, len(wins), context, stride, nll / done, time.perf_counter() - t0, lp)
    if reference is not None:
        out.kl = np.concatenate(kls)
        out.top1_agreement = agree / done
        out.reference_nll_mean = -float(reference.target_logprob.astype(np.float64).mean())
    return out
