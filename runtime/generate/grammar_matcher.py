"""Constrained decoding's machinery: a Grammar (grammar.py) compiled by llguidance against the model's tokenizer, and
a matcher per sequence whose token mask leaves the logits only what the grammar allows next.

`GrammarCompiler` builds the tokenizer llguidance needs once (grammar_tokenizer.py: from tokenizer.json, at the width
of the model's logits, so ids past the tokenizer's vocabulary, its padding, are never allowed), compiles each grammar
once and hands out matchers; `GrammarMatcher` follows one sequence's tokens. Where a grammar is complete and allows
nothing else, its mask allows only EOS: the sequence ends there. JSON is compact (no whitespace between its tokens),
as a model's answer needs none and a model that rambles cannot fill it with blanks. llguidance computes a mask on the
host (a bit per token); it is applied to the logits on their device.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from dsfp4.errors import ConfigError, DsfpError
from dsfp4.runtime.generate.grammar import Grammar
from dsfp4.runtime.generate.grammar_tokenizer import llguidance_tokenizer

# the JSON compiler's options: no whitespace between tokens (the separators are its defaults, "," and ":")
JSON_OPTIONS = {"whitespace_flexible": False}
# compiled grammars kept (the least recently used goes first): an agent's requests repeat the same few
COMPILED_KEPT = 64
# bits of one word of llguidance's mask
WORD_BITS = 32


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


class GrammarCompiler:
    """Grammars compiled against one model's tokenizer (tokenizer.json at `tokenizer_json`, logits of `vocab` ids,
    `eos_ids` ending an answer), each once: the tokenizer is built at the first compile."""

    def __init__(self, tokenizer_json: Path, vocab: int, eos_ids: Iterable[int]):
        self.path, self.vocab, self.eos_ids = Path(tokenizer_json), vocab, tuple(sorted(eos_ids))
        self.tokenizer: Any = None
        # mask words a matcher writes (set with the tokenizer)
        self.words = 0
        # Grammar -> a matcher at its start, copied for each sequence
        self.compiled: OrderedDict[Grammar, Any] = OrderedDict()

    def llguidance(self) -> Any:
        """The library, with the tokenizer built at the first call."""
        try:
            import llguidance
        except ImportError as e:
            raise ConfigError("constrained decoding needs llguidance: reinstall dsfp4 (pip install -e .)") from e
        if self.tokenizer is None:
            if not self.eos_ids:
                raise ConfigError(f"{self.path}: no EOS token is known, so a grammar could not end the answer")
            try:
                self.tokenizer = llguidance_tokenizer(llguidance, self.path, self.vocab, self.eos_ids)
            except (OSError, ValueError, KeyError) as e:
                raise ConfigError(f"{self.path}: llguidance cannot read this tokenizer ({e})") from e
            # a bit per token of its vocabulary, which a mask fills exactly
            self.words = -(-self.tokenizer.vocab_size // WORD_BITS)
        return llguidance

    def compile(self, grammar: Grammar) -> None:
        """Compile `grammar` (kept: a second compile is free); one that does not compile is a ConfigError that names
        its origin and llguidance's reason."""
        if grammar in self.compiled:
            self.compiled.move_to_end(grammar)
            return
        llg = self.llguidance()
        text = _grammar_text(llg, grammar)
        if err := llg.LLMatcher.validate_grammar(text, self.tokenizer):
            raise ConfigError(f"{grammar.origin}: {grammar.describe()} does not compile: {_one_line(err)}")
        template = llg.LLMatcher(self.tokenizer, text, log_level=0)
        if template.is_error():
            raise ConfigError(
                f"{grammar.origin}: {grammar.describe()} does not compile: {_one_line(template.get_error())}"
            )
        self.compiled[grammar] = template
        while len(self.compiled) > COMPILED_KEPT:
            self.compiled.popitem(last=False)

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        """A matcher at the start of `grammar` (compiled now if it is not yet) for one sequence."""
        self.compile(grammar)
        return GrammarMatcher(self.compiled[grammar].deep_copy(), self.words, self.eos_ids)


def _grammar_text(llg: Any, grammar: Grammar) -> str:
    """llguidance's grammar definition of `grammar`."""
    if grammar.kind == "lark":
        return llg.LLMatcher.grammar_from_lark(grammar.source)
    schema = '{"type": "object"}' if grammar.kind == "json_object" else grammar.source
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as e:
        raise ConfigError(f"{grammar.origin}: {grammar.describe()} does not compile: {_one_line(str(e))}") from e


def _one_line(message: str) -> str:
    """llguidance's message (a Lark error points at its line over several) on one line."""
    return " | ".join(line.strip() for line in message.strip().splitlines() if line.strip())
