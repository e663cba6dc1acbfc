"""Prompt reuse: which positions of the caches a new prompt keeps instead of prefilling them.

The caches (the decoder's, and the MTP layer's under --mtp) hold the tokens of the last call, so a chat turn keeps
its common prefix with them. With --prompt-cache (runtime/generate/prompt_cache.py) a longer saved prefix is
restored from disk instead, and a prompt that prefilled enough new tokens is saved there after its prefill.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch

from dsfp4.errors import ConfigError
from dsfp4.runtime.generate.decoder import Decoder
from dsfp4.runtime.generate.prompt_cache import MIN_NEW_TOKENS, PromptCache
from dsfp4.runtime.generate.speculative import Speculator
from dsfp4.runtime.generate.stats import GenerationStats
from dsfp4.runtime.generate.steps import common_prefix
from dsfp4.runtime.models.protocol import Model
from dsfp4.runtime.plan.budget import parse_size


def open_prompt_cache(
    model: Model, model_dir: Path, folder: Path, size: str, conversion: str, fp8_attention: bool = False
) -> PromptCache:
    """--prompt-cache: entries of this conversion, dtype and caches (and --fp8-attention's, whose prefill writes
    other rows past the first layer), the folder held to `size`."""
    caches = model.positional_caches()
    if caches is None:
        raise ConfigError(
            f"--prompt-cache: {model_dir}'s caches (DeepSeek-V4's compressed ones) are not saved by position; "
            "run it without --prompt-cache"
        )
    rows = {name: [list(t.shape[1:]), str(t.dtype)] for name, t in caches.items()}
    identity = {"conversion": conversion, "rows": rows} | ({"attention": "fp8"} if fp8_attention else {})
    return PromptCache(folder, parse_size(size, "--prompt-cache-size"), identity)


class PromptReuse:
    """The reuse of one sequence's caches (slot 0): the decoder's, the speculator's MTP entries (None: no --mtp) and
    the prompt cache (None: no --prompt-cache). `model` gives the model, or the closed engine's error."""

    def __init__(
        self,
        decoder: Decoder,
        speculator: Speculator | None,
        cache: PromptCache | None,
        model: Callable[[], Model],
    ):
        self.decoder, self.speculator, self.cache, self.model = decoder, speculator, cache, model

    def reusable(self, prompt_ids: list[int]) -> int:
        """Cached tokens this prompt may keep: its common prefix with the cache, short of its last token, as far
        as the MTP entries and the model's caches allow (V4's hold their last positions only)."""
        common = common_prefix(self.decoder.cached, prompt_ids)
        reuse = min(common, len(prompt_ids) - 1, self.speculator.reusable(common) if self.speculator else common)
        return self.model().reusable(reuse)

    def restore(self, prompt_ids: list[int], reuse: int) -> int:
        """--prompt-cache: restore a saved prefix of the prompt when it serves more than the `reuse` positions the
        cache keeps, MTP entries counted -> the positions the prompt then reuses (0: nothing restored)."""
        pc = self.cache
        hit = None if pc is None else pc.find(prompt_ids, reuse)
        if hit is None:
            return 0
        upto = min(hit.mtp_upto, hit.common)
        gain = hit.common if self.speculator is None else self.speculator.reusable(hit.common, upto)
        if self.model().reusable(gain) <= reuse or not pc.restore(hit, self.model().positional_caches()):
            return 0
        self.decoder.cached = list(prompt_ids[: hit.common])
        if self.speculator is not None:
            self.speculator.upto = upto
        return self.reusable(prompt_ids)

    def keep(self, prompt_ids: list[int]) -> tuple[int, int]:
        """Keep the cached prefix the prompt may reuse, or restore a longer one from the prompt cache -> (prompt tokens
        cached, of them restored). The cache grows chunk by chunk from here, valid should the prefill be interrupted; a
        prompt fed layer by layer (decoder.py) grows it only once every block has taken every chunk."""
        reuse = self.reusable(prompt_ids)
        restored = self.restore(prompt_ids, reuse)
        reuse = max(reuse, restored)
        self.truncate(reuse)
        return reuse, restored

    def truncate(self, n: int) -> None:
        """Keep the first n cached positions (main and MTP caches): later ones belong to other tokens."""
        self.decoder.truncate(n)
        if self.speculator is not None:
            self.speculator.truncate(n)

    def prefill(self, prompt_ids: list[int], cancel: threading.Event | None, stats: GenerationStats) -> torch.Tensor:
        """A batch's new sequence: its prompt into slot 0 as a generation's would go (reuse, prompt cache) -> logits
        after its last token [V]."""
        stats.cached_tokens, stats.restored_tokens = self.keep(prompt_ids)
        logits = self.decoder.prefill(prompt_ids[stats.cached_tokens :], cancel)
        self.save(prompt_ids, stats)
        return logits

    def save(self, prompt_ids: list[int], stats: GenerationStats) -> None:
        """--prompt-cache: save the prompt's KV when enough of it was prefilled here to be worth a file."""
        if self.cache is None:
            return
        stats.prompt_cache_note = self.cache.take_notes()
        # short of the prompt when it was cancelled
        filled = common_prefix(self.decoder.cached, prompt_ids)
        # a prefill this long costs more than restoring it
        if filled - stats.cached_tokens >= MIN_NEW_TOKENS:
            upto = self.speculator.upto if self.speculator is not None else 0
            self.cache.save(prompt_ids[:filled], self.model().positional_caches(), upto)
