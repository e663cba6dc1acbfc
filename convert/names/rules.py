"""The name map's vocabulary: a rule maps one source name to one dsfp4 name, a family's storage says how its
checkpoints store weights, and the Mapper consumes every source tensor exactly once or skips it for a stated
reason (a missing, unexpected, misshapen or oddly typed tensor is a SourceError naming it)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from dsfp4.errors import FormatError, SourceError
from dsfp4.layout.formats import FORMATS, component_shapes, shape_numel
from dsfp4.layout.model_args import ModelArgs
from dsfp4.layout.safetensors_file import TensorInfo

# matrix DeepSeek's release stores in FP8: goes to the backbone format
LINEAR = "linear"
# matrix kept in the form the source stores it (MTP eh_proj)
AUX = "aux"
# norms, router, bias, embedding, head: kept as stored
PLAIN = "plain"
# routed expert projection: goes into the layer's expert records
EXPERT = "expert"

# of the ModelArgs, or of a placed rule's shape context
Shape = Callable[[Any], tuple[int, ...]]


def _always(a: ModelArgs) -> bool:
    return True


@dataclass(frozen=True)
class Rule:
    """hf: source name under the prefix (a module path for matrices); ref: dsfp4 name under the prefix."""

    hf: str
    ref: str
    kind: str
    shape: Shape
    when: Callable[[ModelArgs], bool] = _always

    def names(self, prefix: str, block: int | None, expert: int | None = None) -> tuple[str, str]:
        """Placed at (prefix, block, expert), as NameMap.placed yields it -> (source name, dsfp4 name)."""
        ref = ("" if block is None else f"layers.{block}.") + self.ref.format(e=expert)
        return prefix + self.hf.format(e=expert), ref


@dataclass(frozen=True)
class SourceStorage:
    """How a family's checkpoint stores weights. matrices: format -> component -> (name suffix after the
    module path, safetensors dtype), the first listed with a matching weight dtype wins where several share a
    scale suffix; plain: safetensors dtype -> plain format."""

    matrices: dict[str, dict[str, tuple[str, str]]]
    plain: dict[str, str]

    def matrix_format(self, hf: str, tensors: dict[str, TensorInfo]) -> str | None:
        """The format a matrix at module path `hf` is stored in (None: no scale tensor, a plain matrix)."""
        found = [f for f, comps in self.matrices.items() if f"{hf}.{comps['scale'][0]}" in tensors]
        weight = tensors.get(f"{hf}.weight")
        typed = [f for f in found if weight is not None and self.matrices[f]["weight"][1] == weight.dtype]
        return (typed or found or [None])[0]


PLAIN_STORAGE = {"BF16": "bf16", "F16": "f16", "F32": "f32"}
# rule, source prefix, block, expert, shape context
Placed = tuple[Rule, str, "int | None", "int | None", object]


@dataclass(frozen=True)
class MappedTensor:
    """One dsfp4 weight and the source tensors it is made of (components as in FORMATS[storage])."""

    ref: str
    kind: str
    part: str
    shape: tuple[int, ...]
    storage: str
    sources: dict[str, str]
    expert: int | None = None


@dataclass(frozen=True)
class TensorMap:
    items: tuple[MappedTensor, ...]
    skipped: dict[str, str]


def part_name(block: int | None) -> str:
    return "top" if block is None else f"layer-{block:03d}"


class Mapper:
    def __init__(
        self,
        args: ModelArgs,
        tensors: dict[str, TensorInfo],
        where: dict[str, str],
        index: str,
        storage: SourceStorage,
    ):
        self.args, self.tensors, self.where, self.index, self.storage = args, tensors, where, index, storage
        self.consumed: set[str] = set()
        self.skipped: dict[str, str] = {}
        self.items: list[MappedTensor] = []

    def take(self, name: str, dtype: str, shape: tuple[int, ...], why: str) -> None:
        if name not in self.tensors:
            raise SourceError(f"tensor {name} is missing from {self.index} ({why})")
        if name in self.consumed:
            raise SourceError(f"tensor {name} would be consumed twice; the name map is inconsistent")
        info = self.tensors[name]
        if info.dtype != dtype:
            raise SourceError(f"tensor {name} in {self.where[name]} has dtype {info.dtype}, expected {dtype}")
        same = info.shape == shape or (shape == () and shape_numel(info.shape) == 1)
        if not same:
            raise SourceError(
                f"tensor {name} in {self.where[name]} has shape {list(info.shape)}; config.json implies {list(shape)}"
            )
        self.consumed.add(name)

    def add(self, rule: Rule, prefix: str, block: int | None, expert: int | None = None, ctx: object = None) -> None:
        """ctx: what the rule's shape reads (default: the ModelArgs; V4 passes the layer's geometry)."""
        plain = self.storage.plain
        hf, ref = rule.names(prefix, block, expert)
        shape = rule.shape(self.args if ctx is None else ctx)
        why = "config.json implies it"
        if rule.kind == PLAIN:
            info = self.tensors.get(hf)
            storage = plain.get(info.dtype) if info else "bf16"
            if storage is None:
                raise SourceError(
                    f"tensor {hf} in {self.where[hf]} has dtype {info.dtype}, expected one of {', '.join(plain)}"
                )
            self.take(hf, info.dtype if info else "BF16", shape, why)
            sources = {"weight": hf}
        else:
            storage = self.storage.matrix_format(hf, self.tensors)
            if storage is None:
                info = self.tensors.get(f"{hf}.weight")
                storage = plain.get(info.dtype, "bf16") if info else "bf16"
                if info and info.dtype not in plain:
                    scale = next(iter(self.storage.matrices.values()))["scale"][0]
                    raise SourceError(
                        f"tensor {hf}.weight in {self.where[hf + '.weight']} has dtype "
                        f"{info.dtype} but no scale tensor; expected {', '.join(plain)}, or FP8 "
                        f"with {hf}.{scale}"
                    )
            spec = FORMATS[storage]
            try:
                shapes = component_shapes(spec, shape, hf)
            except FormatError as e:
                raise SourceError(str(e)) from e
            stored = self.storage.matrices.get(storage, {"weight": ("weight", spec.components[0][1])})
            sources = {}
            for (comp, _), comp_shape in zip(spec.components, shapes, strict=True):
                suffix, dtype = stored[comp]
                sources[comp] = f"{hf}.{suffix}"
                self.take(sources[comp], dtype, comp_shape, why)
            if storage == "nvfp4" and f"{hf}.input_scale" in self.tensors:
                self.skip(f"{hf}.input_scale", INPUT_SCALE_REASON)
        self.items.append(MappedTensor(ref, rule.kind, part_name(block), shape, storage, sources, expert))

    def skip(self, name: str, reason: str) -> None:
        self.skipped[name] = reason
        self.consumed.add(name)


INPUT_SCALE_REASON = "static activation scale of an NVFP4 export (activations stay BF16)"
NO_MTP_REASON = "MTP layer left out by --no-mtp"


@dataclass(frozen=True)
class NameMap:
    """One family's checkpoint names: its rules placed for a model, how it stores weights, the name prefixes
    of its MTP blocks, and the tensors it skips on purpose (pattern, reason)."""

    placed: Callable[[ModelArgs, bool], Iterator[Placed]]
    storage: SourceStorage
    # (n_layers, n_mtp_layers) -> source name prefixes
    mtp_prefixes: Callable[[int, int], tuple[str, ...]]
    skips: tuple[tuple[re.Pattern, str], ...] = ()
