"""Log-probabilities a generation reports: per generated token, its log-probability and the most likely alternatives,
and per prompt token (completions' echo) the same under the logits before it.

Which distribution: log_softmax of the logits after the sequence's penalties and grammar mask, before temperature,
min-p, top-k and top-p (vLLM's "processed logits" less its sampling filters; OpenAI's, as far as it says). A token the
grammar refuses has no entry among the alternatives (its log-probability is -inf, which JSON cannot carry). An entry
is a TokenLogprob (generation.py, free of torch: the server's HTTP process formats it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsfp4.runtime.generate.generation import TokenLogprob


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """logits [V] (as processed) -> `token`'s entry with `top` alternatives (one host sync)."""
    logp = logits.float().log_softmax(-1)  # [V]
    values, ids = logp.topk(min(top, logp.numel())) if top else (logp[:0], logp[:0].long())
    finite = [(i, v) for i, v in zip(ids.tolist(), values.tolist(), strict=True) if v != float("-inf")]
    return TokenLogprob(token, float(logp[token]), tuple(finite))


def prompt_logprobs(logits: torch.Tensor, ids: Sequence[int], top: int) -> list[TokenLogprob | None]:
    """The prompt's own tokens under the logits after each one (logits: [T, V], Engine.logits(ids)) -> an entry per
    token of ids, None for the first (nothing comes before it). Raw logits: a prompt has no penalties or grammar."""
    assert len(ids) == len(logits), "one row of logits per prompt token"
    logp = logits.float().log_softmax(-1)[:-1]  # [T-1, V]: row i predicts token i + 1
    following = torch.tensor(list(ids[1:]), dtype=torch.long)
    chosen = logp.gather(1, following[:, None])[:, 0].tolist()
    if top:
        values, alt = logp.topk(min(top, logp.shape[-1]), dim=-1)
        tops = [tuple(zip(a, v, strict=True)) for a, v in zip(alt.tolist(), values.tolist(), strict=True)]
    else:
        tops = [()] * len(chosen)
    return [None] + [TokenLogprob(t, c, tp) for t, c, tp in zip(ids[1:], chosen, tops, strict=True)]
