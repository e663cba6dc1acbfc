"""A Grammar (grammar.py) compiled by llguidance against the model's tokenizer: `GrammarCompiler` builds the tokenizer
llguidance needs once (grammar_tokenizer.py: from tokenizer.json, at the width of the model's logits, so ids past the
tokenizer's vocabulary, its padding, are never allowed), compiles each grammar once and hands out matchers
(grammar_matcher.py). Free of torch, which only a matcher needs: the server's HTTP process compiles a request's
grammar here to refuse one that does not compile before anything streams.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsfp4.errors import ConfigError
from dsfp4.runtime.generate.answer.grammar import Grammar
from dsfp4.runtime.generate.answer.grammar_tokenizer import llguidance_tokenizer

if TYPE_CHECKING:
    from dsfp4.runtime.generate.answer.grammar_matcher import GrammarMatcher

# the JSON compiler's options: no whitespace between tokens (the separators are its defaults, "," and ":")
JSON_OPTIONS = {"whitespace_flexible": False}
# compiled grammars kept (the least recently used goes first): an agent's requests repeat the same few
COMPILED_KEPT = 64
# bits of one word of llguidance's mask
WORD_BITS = 32


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
        # here: the matcher's module imports torch, which the HTTP process leaves out
        from dsfp4.runtime.generate.answer.grammar_matcher import GrammarMatcher

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
