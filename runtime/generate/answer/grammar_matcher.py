"""Constrained decoding's machinery: a Grammar (grammar.py) compiled by llguidance against the model's tokenizer, and
a matcher per sequence whose token mask leaves the logits only what the grammar allows next.

`GrammarCompiler` (grammar_compiler.py, free of torch) compiles each grammar once and hands out matchers;
`GrammarMatcher` follows one sequence's tokens. Where a grammar is complete and allows
nothing else, its mask allows only EOS: the sequence ends there. JSON is compact (no whitespace between its tokens),
as a model's answer needs none and a model that rambles cannot fill it with blanks. llguidance computes a mask on the
host (a bit per token); it is applied to the logits on their device.
"""

from __future__ import annotations

from typing import Any

import torch

from dsfp4.errors import DsfpError

# the compiler lives apart, free of torch (the server's HTTP process compiles a request's grammar to check it)
from dsfp4.runtime.generate.answer.grammar_compiler import WORD_BITS, GrammarCompiler

__all__ = ["GrammarCompiler", "GrammarMatcher"]


class GrammarMatcher:
    """One sequence's place in its grammar: the mask of the tokens allowed next, advanced by each token taken."""

    def __init__(self, matcher: Any, words: int, eos_ids: tuple[int, ...]):
        self.matcher, self.words, self.eos_ids = matcher, words, eos_ids
        # the host's mask words [W] and the bit shifts on the logits' device [32], made at the first mask
        self.host: torch.Tensor | None = None
        self.shifts: torch.Tensor | None = None
        # the mask of the tokens so far (a draft's logits and the check's share it), until the next accept
        self.current: torch.Tensor | None = None

    @property
    def accepting(self) -> bool:
        """The tokens so far are a whole answer (EOS is allowed)."""
        return self.matcher.is_accepting()

    @property
    def done(self) -> bool:
        """Nothing but EOS may follow."""
        return self.matcher.is_stopped()

    def allowed(self, device: torch.device) -> torch.Tensor:
        """The tokens the grammar allows next -> bool [32 W] on `device` (ids past the logits' width are padding)."""
        if self.current is not None and self.current.device == device:
            return self.current
        if self.host is None:
            self.host = torch.zeros(self.words, dtype=torch.int32, pin_memory=device.type == "cuda")
            self.shifts = torch.arange(WORD_BITS, dtype=torch.int32, device=device)
        # llguidance writes the words in place, exactly a bit per token of its tokenizer
        self.matcher.unsafe_compute_mask_ptr(self.host.data_ptr(), self.words * 4)
        self._check()
        words = self.host.to(device)  # [W]
        self.current = ((words[:, None] >> self.shifts) & 1).bool().view(-1)  # [32 W]
        return self.current

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> a copy with every token the grammar refuses at -inf."""
        allowed = self.allowed(logits.device)
        v = logits.shape[-1]
        if allowed.numel() < v:
            allowed = torch.cat([allowed, allowed.new_zeros(v - allowed.numel())])
        return logits.masked_fill(~allowed[:v], float("-inf"))

    def accept(self, token: int) -> None:
        """The sequence took `token` (one the mask allowed)."""
        self.matcher.consume_token(token)
        self.current = None
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise DsfpError(f"constrained decoding lost its grammar: {self.matcher.get_error()}")
