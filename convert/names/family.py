"""A family's name map (convert/family.py names it), the names a checkpoint of a given shape holds, and the mapping
of a source's tensors with its completeness check."""

from __future__ import annotations

from dsfp4.convert.family import source_family
from dsfp4.convert.names.rules import NO_MTP_REASON, PLAIN, Mapper, NameMap, TensorMap
from dsfp4.errors import SourceError
from dsfp4.layout.model_args import ModelArgs
from dsfp4.layout.safetensors_file import TensorInfo


def name_map(args: ModelArgs | str | None) -> NameMap:
    """The name map of the model's family (ModelArgs.family: config.json's model_type; V3's when unknown)."""
    return source_family(args).names


def source_names(args: ModelArgs) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name (matrices: their weight) -> (logical shape, rule kind) of every tensor a checkpoint of this shape
    holds, in the family's own naming."""
    names = {}
    for rule, prefix, block, expert, ctx in name_map(args).placed(args, True):
        name = rule.names(prefix, block, expert)[0]
        names[name if rule.kind == PLAIN else name + ".weight"] = (rule.shape(ctx), rule.kind)
    return names


def plain_checkpoint_names(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of an unquantized (BF16) Hugging Face checkpoint of this shape."""
    return {name: shape for name, (shape, _) in source_names(args).items()}


def map_tensors(
    args: ModelArgs, tensors: dict[str, TensorInfo], where: dict[str, str], index: str, include_mtp: bool = True
) -> TensorMap:
    """Map every source tensor (name -> header info; `where`: name -> shard) or raise SourceError."""
    names = name_map(args)
    m = Mapper(args, tensors, where, index, names.storage)
    for rule, prefix, block, expert, ctx in names.placed(args, include_mtp):
        try:
            m.add(rule, prefix, block, expert, ctx)
        except SourceError as e:
            if block is not None and block >= args.n_layers:
                raise SourceError(f"{e}; to convert without the MTP layer pass --no-mtp") from e
            raise
    mtp_prefixes = names.mtp_prefixes(args.n_layers, args.n_mtp_layers)
    for name in tensors:
        if name in m.consumed:
            continue
        if not include_mtp and name.startswith(mtp_prefixes):
            m.skip(name, NO_MTP_REASON)
        elif reason := next((r for p, r in names.skips if p.fullmatch(name)), None):
            m.skip(name, reason)
    unexpected = sorted(set(tensors) - m.consumed)
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise SourceError(
            f"unexpected tensor {unexpected[0]} in {where[unexpected[0]]}{more}: config.json "
            f"({args.family}, {args.n_layers} layers + {args.n_mtp_layers} MTP, "
            f"{args.n_routed_experts} experts) has no place for it"
        )
    return TensorMap(tuple(m.items), m.skipped)
