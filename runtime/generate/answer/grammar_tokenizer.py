"""The model's tokenizer as llguidance sees it: every token id's bytes, which ones are special, and how text
tokenizes.

llguidance reads a tokenizer.json by itself, but takes every added token for a special one: DeepSeek's tool-call
markers (`<｜tool▁calls▁begin｜>` and the rest) are added tokens that are not special, whose text a grammar spells
as a string, and a mask would then allow the model's own single token for that text yet refuse it once taken. So the
bytes are given here: a byte-level BPE's tokens decoded from its byte alphabet, an added token's text as UTF-8,
special only where tokenizer.json says so; ids past the tokenizer (the logits' padding) are special ones no grammar
names. A tokenizer that is not byte-level goes to llguidance's own reading.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

# GPT-2's byte alphabet: these bytes stand for themselves, the others for the code points from 256 on, in order
PRINTABLE = (range(ord("!"), ord("~") + 1), range(0xA1, 0xAC + 1), range(0xAE, 0xFF + 1))


def byte_alphabet() -> dict[str, int]:
    """A byte-level BPE's character -> the byte it stands for."""
    printable = {b for r in PRINTABLE for b in r}
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _byte_level(cfg: dict) -> bool:
    """tokenizer.json decodes with ByteLevel (alone or in a sequence)."""
    decoder = cfg.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in parts)


class TokenTable:
    """What llguidance's TokenizerWrapper reads: `tokens` (bytes per id, `vocab` of them), `special_token_ids`, EOS and
    BOS, and calling it tokenizes text."""

    def __init__(self, tok: Tokenizer, cfg: dict, vocab: int, eos: int):
        alphabet = byte_alphabet()
        added = {a["id"]: a for a in cfg.get("added_tokens", [])}
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for i in range(vocab):
            text = added[i]["content"] if i in added else tok.id_to_token(i)
            if text is None or (i in added and added[i].get("special")):
                self.special_token_ids.append(i)
            if text is None:
                # a name of its own: an empty special token passed wherever a lexeme may be empty (`/\\s*/`)
                self.tokens.append(f"<|padding_{i}|>".encode())
            elif i in added:
                self.tokens.append(text.encode("utf-8"))
            else:
                self.tokens.append(bytes(alphabet[c] for c in text))
        self.eos_token_id, self.bos_token_id = eos, None
        self.tok = tok

    def __call__(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids


def llguidance_tokenizer(llg: Any, path: Path, vocab: int, eos_ids: tuple[int, ...]) -> Any:
    """llguidance's LLTokenizer of tokenizer.json at `path`, `vocab` ids wide (the logits'), ending at `eos_ids`."""
    text = path.read_text()
    cfg = json.loads(text)
    if not _byte_level(cfg):
        return llg.LLTokenizer(text, n_vocab=vocab, eos_token=list(eos_ids))
    table = TokenTable(Tokenizer.from_str(text), cfg, vocab, eos_ids[0])
    return llg.LLTokenizer(llg.TokenizerWrapper(table), n_vocab=vocab, eos_token=list(eos_ids))
