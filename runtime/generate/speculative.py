"""MTP speculative decoding (`dsfp4 run --mtp`): the checkpoint's own MTP module drafts the next token, one
forward of the main model over [last token, draft] checks it, and the agreeing draft plus the main model's
own next token are kept (one draft per step: DeepSeek-V3 has one MTP module).

Positions: the MTP module's cache entry i holds (the main model's final hidden state at i, the embedding of
token i+1) at rotary position i (checkpoint-spec c.9); its logits there draft token i+2. An entry stays valid
while the token after it is in the main cache, which bounds how much of a cached prefix a call can reuse.
A rejected draft's entry in the main cache is simply overwritten by the next step (the cached-token list
is what says which positions hold valid KV).

Adaptive: the first PROBE_PLAIN decode steps run plain, which times a plain step. After JUDGE_AFTER verify
steps, drafting goes on only while (tokens per verify step) / (verify step time) beats 1 / (plain step time),
as measured; otherwise the rest of the generation decodes plain and the stats say why. Under heavy SSD
streaming a verify step loads the experts of two tokens, so this is where drafting can stop paying.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from dsfp4.errors import ConfigError
from dsfp4.runtime.generate.decoder import Decoder
from dsfp4.runtime.generate.logits_rules import TokenRules, pick
from dsfp4.runtime.generate.sampling import check_draft, distribution, draw
from dsfp4.runtime.generate.sampling_params import SamplingParams
from dsfp4.runtime.generate.stats import GenerationStats
from dsfp4.runtime.models.v3.model import Transformer
from dsfp4.runtime.plan.limits import MTP_BATCH

# plain decode steps timed before drafting starts
PROBE_PLAIN = 2
# verify steps measured before drafting may be judged not to pay
JUDGE_AFTER = 8


class Speculator:
    """The MTP drafter and the verify loop over one decoder (its model loaded with the MTP block, which the engine
    checks is there)."""

    def __init__(self, decoder: Decoder, model: Transformer):
        self.decoder, self.model, self.mtp = decoder, model, model.mtp[0]
        # MTP cache entries filled: positions 0 .. upto-1
        self.upto = 0
        # tests turn it off to keep drafting whatever it costs
        self.adaptive = True
        # tests set 0 to draft from the first decode step
        self.probe_plain = PROBE_PLAIN
        # test hook, greedy: (position, draft) -> token
        self.override: Callable[[int, int], int] | None = None
        # times the steps (tests give a clock of their own)
        self.clock: Callable[[], float] = time.perf_counter

    def truncate(self, n: int) -> None:
        """The main cache keeps its first n positions: entries past them are stale."""
        self.upto = min(self.upto, n)

    def reusable(self, common: int, upto: int | None = None) -> int:
        """How many cached tokens a call sharing `common` tokens with the cache may reuse: every reused
        position needs a valid MTP entry, and entry i is valid only if token i+1 is shared too. `upto`: the MTP
        entries held (default: this speculator's; a prompt-cache entry brings its own)."""
        return max(min(self.upto if upto is None else upto, common - 1), 0)

    def _extend(self, h: torch.Tensor, next_tokens: list[int], start: int, head: bool = True) -> torch.Tensor:
        """MTP entries for positions start.. from main hidden states h [t, D] and the tokens after them ->
        the logits drafting the token after the last one [V] (None without `head`)."""
        # on h's device: a split run's last card, the MTP layer's
        freqs, mask = self.model.positions(len(next_tokens), start, h.device)
        tokens = torch.tensor([next_tokens], device=h.device)
        logits = self.mtp(h[None], tokens, start, freqs, mask, last_only=True, head=head)  # [1, 1, V]
        self.upto = start + len(next_tokens)
        return logits[0, -1] if head else None

    def entries(self, h: torch.Tensor, ids: list[int], base: int, offset: int) -> None:
        """Entries for a chunk of ids just fed at positions base + offset ..: h [t, D] are its main hidden
        states; an entry is made wherever the next token is known."""
        nxt = ids[offset + 1 : offset + len(h) + 1]
        if nxt:
            self._extend(h[: len(nxt)], nxt, base + offset, head=False)

    def _flush(self, pending: _Pending, head: bool) -> torch.Tensor | None:
        """Compute the entries that wait; with `head`, the logits drafting the next token."""
        logits = self._extend(torch.cat(pending.h), pending.next, pending.at, head) if pending.h else None
        pending.h, pending.next, pending.at = [], [], self.upto
        return logits

    def _draft(
        self, logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator | None, rules: TokenRules | None
    ):
        """(draft token, the distribution it was drawn from [V], None when greedy) from MTP logits [V], under the
        sequence's rules where it has them (a draft the grammar refuses is not drawn)."""
        if rules is not None:
            logits = rules.process(logits)
        if not sampling.greedy:
            if self.override is not None:
                raise ConfigError("the override test hook is for greedy decoding only")
            q = distribution(logits, sampling)
            return draw(q, gen), q
        d = int(logits.argmax())
        # position of the draft
        return (d if self.override is None else self.override(self.upto + 1, d)), None

    def tokens(
        self,
        ids: list[int],
        sampling: SamplingParams,
        gen: torch.Generator | None,
        cancel: threading.Event | None,
        stats: GenerationStats,
        budget: int,
        rules: TokenRules | None = None,
    ) -> Iterator[int]:
        """Prefill ids after the cached tokens, then yield up to `budget` generated tokens. A token is fed to
        the model only when the next one is asked for, as the engine's plain decoding does. The sequence's `rules`
        process the draft's and the check's logits alike, and take only the tokens kept."""
        d = self.decoder
        base, offset = len(d.cached), 0
        # h: [t, D]
        for chunk_logits, h in d.feed(ids, cancel):
            self.entries(h, ids, base, offset)
            offset, last_h, logits = offset + len(h), h[-1:], chunk_logits
        token = pick(rules, logits, sampling, gen)
        # the last prompt position's entry waits for the token just sampled; plain steps add one each
        pending = _Pending(base + len(ids) - 1, [last_h], [token])
        drafting = fallback = False
        produced = 1
        try:
            yield token
            while produced < budget:
                # a verify step needs two free cache positions and two tokens of budget
                room = min(budget - produced, d.max_context - len(d.cached))
                if not drafting and not fallback and stats.plain_steps >= self.probe_plain and room >= 2:
                    draft_logits, drafting = self._flush(pending, head=True), True
                t0 = self.clock()
                if not drafting or room < 2:
                    # h: [1, D]
                    logits, h = d.forward([token], cancel)
                    token = pick(rules, logits, sampling, gen)
                    stats.plain_steps, stats.plain_s = stats.plain_steps + 1, stats.plain_s + self.clock() - t0
                    pending.h.append(h)
                    pending.next.append(token)
                    if fallback and len(pending.h) >= MTP_BATCH:
                        # keep the entries current for the next call
                        self._flush(pending, head=False)
                    produced += 1
                    yield token
                    continue
                draft, q = self._draft(draft_logits, sampling, gen, rules)
                # the position of `token`
                at = len(d.cached)
                logits, h = d.forward([token, draft], cancel, every=True)  # [2, V], [2, D]
                target = logits[0] if rules is None else rules.process(logits[0])
                checked, ok = check_draft(target, q, draft, sampling, gen)
                if rules is not None:
                    rules.accept(checked, target)
                # the draft stands, and the main model's logits after it give one more token for free
                if ok:
                    out = [draft, pick(rules, logits[1], sampling, gen)]
                    draft_logits = self._extend(h, out, at)
                else:
                    # the draft's KV at at+1 is stale: the next step overwrites it
                    d.drop_last()
                    out = [checked]
                    draft_logits = self._extend(h[:1], out, at)
                stats.drafted, stats.accepted = stats.drafted + 1, stats.accepted + ok
                stats.verify_s += self.clock() - t0
                if self.adaptive and stats.drafted >= JUDGE_AFTER and not _pays(stats):
                    drafting, fallback = False, True
                    stats.mtp_note = _why_not(stats)
                pending.at = self.upto
                produced += len(out)
                yield from out
                token = out[-1]
        except GeneratorExit:
            # the caller has its tokens: bring the entries up to date for the next call
            self._flush(pending, head=False)
            raise


@dataclass
class _Pending:
    """MTP entries waiting to be computed: from position `at`, main hidden rows and the tokens after them."""

    at: int
    h: list[torch.Tensor] = field(default_factory=list)
    next: list[int] = field(default_factory=list)


def _pays(s: GenerationStats) -> bool:
    """Tokens per second drafting (as measured) against plain decoding's."""
    if not s.plain_steps or not s.verify_s:
        return True
    return (s.drafted + s.accepted) / s.verify_s > s.plain_steps / s.plain_s


def _why_not(s: GenerationStats) -> str:
    ratio = (s.verify_s / s.drafted) / (s.plain_s / s.plain_steps)
    return (
        f"drafting stopped after {s.drafted} verify steps: {s.accepted / s.drafted:.0%} of drafts accepted, "
        f"{(s.drafted + s.accepted) / s.drafted:.2f} tokens per verify step, which takes {ratio:.2f}x a plain step"
    )
