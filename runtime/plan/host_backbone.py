"""What of the backbone the plan keeps in pinned host memory, read in place by the device over PCIe, when the whole
backbone does not fit the device budget (a 16 GB card and DeepSeek-V3's FP8 backbone).

Layers' KV caches go first, where the family's model can keep them there (MLA's latent cache): a decode step reads
a cache's rows up to its position, at most the cache's bytes and, short of the full context, fewer, where a layer's
weights are read whole every step (V3 at 163,840 positions: 189 MB of latent rows a layer against ~230 MB of weights).

First the embedding table: a token reads one row of it, so in host memory it costs a few KB of PCIe per token for
1.75 GiB of VRAM (a tied embedding is the head too, which reads all of it: it stays). Then whole decoder layers,
the largest first (V3's dense layers), later layers before earlier ones among equals: every decode token reads a
streamed layer's bytes over PCIe once, in the same kernels (runtime/models/host_memory.py gives them device
addresses of the pinned pages), where the experts' copies from RAM compete for the link.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsfp4.layout.formats import FORMATS, shape_numel, stored_nbytes
from dsfp4.layout.manifest import Manifest

FP32 = 4
# kept in fp32 (see moe.Gate)
ROUTER_SUFFIXES = ("ffn.gate.weight", "ffn.gate.bias")
EMBED = "embed.weight"
INTEGER_FORMATS = ("i64",)


@dataclass(frozen=True)
class HostBackbone:
    """The backbone tensors kept in pinned host memory: the embedding (`embed`) and every tensor of `layers`; and the
    KV caches of `caches`."""

    embed: bool = False
    layers: tuple[int, ...] = ()
    caches: tuple[int, ...] = ()

    def holds_cache(self, layer: int) -> bool:
        """Whether layer `layer`'s KV caches live in host memory under this placement."""
        return layer in self.caches

    def holds(self, name: str) -> bool:
        """Whether the backbone tensor `name` (a manifest name) lives in host memory under this placement."""
        if name == EMBED:
            return self.embed
        return name.startswith("layers.") and int(name.split(".")[1]) in self.layers

    def describe(self) -> str:
        """For the plan table: what is in host memory, read over PCIe in place."""
        layers = f"layer{'s' * (len(self.layers) > 1)} {spans(self.layers)}"
        what = ["embedding"] * self.embed + [layers] * bool(self.layers)
        return ", ".join(what) + ": read in place over PCIe"

    def describe_caches(self) -> str:
        """For the plan table: whose KV caches are in host memory."""
        return f"layer{'s' * (len(self.caches) > 1)} {spans(self.caches)}'s caches: read in place over PCIe"


def spans(values: tuple[int, ...]) -> str:
    """(0, 1, 2, 7, 9, 10) -> '0-2, 7, 9-10'."""
    out, run = [], []
    for v in sorted(values):
        if run and v != run[-1] + 1:
            out.append(run)
            run = []
        run.append(v)
    out += [run] if run else []
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out)


def tensor_bytes(name: str, entry, elt: int) -> int:
    """Bytes of a backbone tensor as loaded: quantized matrices as stored, plain tensors in the runtime dtype
    (`elt` bytes an element), the router in fp32."""
    spec = FORMATS[entry.format]
    # as stored (V4's tid2eid: int64)
    if spec.scale is not None or entry.format in INTEGER_FORMATS:
        return stored_nbytes(spec, tuple(entry.shape))
    return shape_numel(entry.shape) * (FP32 if name.endswith(ROUTER_SUFFIXES) else elt)


def layer_bytes(manifest: Manifest, elt: int, layers: range) -> dict[int, int]:
    """Bytes of each of `layers`' backbone tensors as loaded."""
    out = dict.fromkeys(layers, 0)
    for name, t in manifest.tensors.items():
        if name.startswith("layers.") and (i := int(name.split(".")[1])) in out:
            out[i] += tensor_bytes(name, t, elt)
    return out


def step_bytes_on_host(manifest: Manifest, on_host: HostBackbone, elt: int) -> int:
    """Bytes of host backbone one decode step of one token reads over PCIe: every held tensor, the embedding's row."""
    total = 0
    for name, t in manifest.tensors.items():
        if on_host.holds(name):
            n = tensor_bytes(name, t, elt)
            total += n // t.shape[0] if name == EMBED else n
    return total


def caches_on_host(sizes: dict[int, int], need: int) -> tuple[tuple[int, ...], int]:
    """The fewest layers' caches (`sizes`: each layer's bytes) whose move leaves at least `need` bytes of the device,
    later layers first: (the layers, bytes moved); all of them when that is still short."""
    chosen, moved = [], 0
    for i in sorted(sizes, reverse=True):
        if moved >= need:
            break
        chosen.append(i)
        moved += sizes[i]
    return tuple(sorted(chosen)), moved


def place_on_host(manifest: Manifest, elt: int, layers: range, need: int) -> tuple[HostBackbone, int]:
    """The least of the backbone to keep in host memory so that at least `need` bytes leave the device: (placement,
    bytes moved). Moves everything it may when that is still short of `need` (the caller then refuses the plan)."""
    a, moved, embed = manifest.args, 0, False
    if need > 0 and not a.tie_word_embeddings and EMBED in manifest.tensors:
        embed, moved = True, tensor_bytes(EMBED, manifest.tensors[EMBED], elt)
    sizes = layer_bytes(manifest, elt, layers)
    chosen = []
    for i in sorted(sizes, key=lambda i: (-sizes[i], -i)):
        if moved >= need:
            break
        chosen.append(i)
        moved += sizes[i]
    return HostBackbone(embed, tuple(sorted(chosen))), moved
