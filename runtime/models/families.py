"""The families the runtime builds, as data: for each (config.json's model_type) its model class and what its runs
may do, which the engine and the loader check options against. What the on-disk contract knows of a family (its
name in messages, its caches' bytes) is layout/family.py's; a new family is an entry here too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dsfp4.layout.family import V2_FAMILY, V3_FAMILY, V4_FAMILY
from dsfp4.layout.model_args import ModelArgs
from dsfp4.runtime.generate.prompt_v4 import encode_v4


@dataclass(frozen=True)
class ModelFamily:
    """model() -> the model class, imported when a model is built (the prompt rules read this table in the server's
    HTTP process, which imports no torch): (args, weights, experts, cache slots, max_len, with_mtp, prefetch) -> the
    Model (models/protocol.py).
    batch: several sequences decode together, each in a cache slot of its own (its caches hold rows by position);
    mtp: speculative decoding drives its MTP layer; prompt_cache: its caches are saved and restored by position
    (Model.positional_caches); split: its layers split across the cards of --devices (runtime/models/card_map.py);
    prompt_format: (messages, thinking, add_generation_prompt) -> the prompt, where the release builds its prompts in
    code, not with a chat template (its format has a thinking switch); None: the checkpoint's chat template."""

    model: Callable[[], type]
    batch: bool
    mtp: bool
    prompt_cache: bool
    split: bool
    prompt_format: Callable[..., str] | None = None


def _v3() -> type:
    from dsfp4.runtime.models.v3.model import Transformer

    return Transformer


def _v4() -> type:
    from dsfp4.runtime.models.v4.model import TransformerV4

    return TransformerV4


_V3 = ModelFamily(_v3, batch=True, mtp=True, prompt_cache=True, split=True)
MODEL_FAMILIES: dict[str, ModelFamily] = {
    V3_FAMILY: _V3,
    V2_FAMILY: _V3,
    # the compressed caches and the window ring hold a running state, not rows by position
    V4_FAMILY: ModelFamily(_v4, batch=False, mtp=False, prompt_cache=False, split=False, prompt_format=encode_v4),
}


def model_family(family: ModelArgs | str | None) -> ModelFamily:
    """The runtime's entry of a model's family (ModelArgs.family, or config.json's model_type); V3's when unknown."""
    name = family.family if isinstance(family, ModelArgs) else family
    return MODEL_FAMILIES.get(name if isinstance(name, str) else V3_FAMILY, _V3)
