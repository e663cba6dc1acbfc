"""The families convert reads, as data: for each (config.json's model_type) the keys its config.json may leave out,
how its config holds RoPE and reads its own keys (convert/source/config_v3.py, config_v4.py), its name map
(convert/names/), and why export writes no checkpoint of it where it does not. What the on-disk contract knows of a
family is layout/family.py's; a new family is an entry here too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsfp4.convert.names.rules import NameMap
from dsfp4.convert.names.v3 import V3_NAMES
from dsfp4.convert.names.v4 import V4_NAMES
from dsfp4.convert.source.config_v3 import one_rope_set, v3_args
from dsfp4.convert.source.config_v4 import v4_args, v4_rope_sets
from dsfp4.layout.family import V2_FAMILY, V3_FAMILY, V4_FAMILY
from dsfp4.layout.model_args import ModelArgs

# (config.json with the defaults, its reader, the fields every family shares, the YaRN RoPE set, the plain one or
# None, the file's name in errors) -> ModelArgs
ConfigReader = Callable[[dict[str, Any], Callable[..., Any], dict[str, Any], dict, Any, str], ModelArgs]


@dataclass(frozen=True)
class SourceFamily:
    """config_defaults: keys the family's config.json may leave out (transformers' DeepseekV3Config, for one, never
    writes scoring_func or topk_method: V3 always uses both); rope_sets: config.json's RoPE dict -> (the YaRN set, the
    plain set or None); no_export: why export writes none of it (None: it writes its name map backwards);
    transformers: the prefix of transformers' classes for it (DeepseekV3 -> DeepseekV3Config, DeepseekV3ForCausalLM),
    which the tests' numerical reference builds (None: none is used)."""

    names: NameMap
    config_defaults: dict[str, Any]
    rope_sets: Callable[[dict], tuple[dict, dict | None]]
    read_config: ConfigReader
    no_export: str | None = None
    transformers: str | None = None


# in the order errors list the supported model types
SOURCE_FAMILIES: dict[str, SourceFamily] = {
    V3_FAMILY: SourceFamily(
        V3_NAMES,
        {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
        one_rope_set,
        v3_args,
        transformers="DeepseekV3",
    ),
    V2_FAMILY: SourceFamily(
        V3_NAMES, {"scoring_func": "softmax", "topk_method": "greedy"}, one_rope_set, v3_args, transformers="DeepseekV2"
    ),
    V4_FAMILY: SourceFamily(
        V4_NAMES,
        # topk_method is a legacy label in V4's config (neither the reference nor transformers reads it); V4 always
        # selects by score + bias outside the hash layers
        {"topk_method": "noaux_tc"},
        v4_rope_sets,
        v4_args,
        no_export=(
            "DeepSeek-V4's own release layout (FP8 blocks, MXFP4 experts) is what engines load for V4; export writes "
            "the DeepSeek-V3 family's"
        ),
    ),
}


def source_family(family: ModelArgs | str | None) -> SourceFamily:
    """The family of a model (ModelArgs.family: config.json's model_type); V3's when unknown."""
    name = family.family if isinstance(family, ModelArgs) else family
    return SOURCE_FAMILIES.get(name if isinstance(name, str) else V3_FAMILY, SOURCE_FAMILIES[V3_FAMILY])
