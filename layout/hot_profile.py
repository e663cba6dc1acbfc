"""hot.json: how often each routed expert was chosen, per MoE layer, measured by `dsfp4 profile-hot`.

  {"format": "dsfp4-hot-1",
   "conversion_sha256": "...",      Manifest.exact_sha256() of the model it was measured on
   "tokens": 16384,                 tokens profiled; every MoE layer routed each of them
   "sources": ["builtin: ..."],     the calibration text (several after --merge)
   "layers": {"3": {"counts": [...], "weights": [...], "order": [...]}, ...}}

counts[e] is how often expert e was among a token's top-k, weights[e] the sum of its routing weights, and
order the layer's experts hottest first (count, then expert id): the order a hot-first repack stores
them in. The runtime warm-starts its tiers from the profile (the hottest records to the GPU, the next to
RAM). A profile belongs to one conversion: another may quantize or number its experts differently, so
a profile of another model or conversion is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dsfp4.errors import ManifestError
from dsfp4.layout.atomic import atomic_write_bytes

if TYPE_CHECKING:
    # a type only: profile-hot's help reads this module, and the manifest's records import torch
    from dsfp4.layout.manifest import Manifest

HOT_NAME = "hot.json"
HOT_FORMAT = "dsfp4-hot-1"


@dataclass(frozen=True)
class HotProfile:
    # Manifest.exact_sha256(): the conversion, its cold records counted as the ones they came from
    conversion: str
    tokens: int
    # MoE layer -> times each expert was chosen
    counts: dict[int, tuple[int, ...]]
    # MoE layer -> summed routing weights
    weights: dict[int, tuple[float, ...]] = field(default_factory=dict)
    sources: tuple[str, ...] = ()

    def order(self, layer: int) -> list[int]:
        """The layer's experts, hottest first; ties in expert order."""
        c = self.counts[layer]
        return sorted(range(len(c)), key=lambda e: (-c[e], e))

    def ranked(self) -> list[tuple[int, int]]:
        """(layer, expert) keys, hottest first across layers (every layer saw the same tokens); ties by
        layer, then expert id. Each layer's keys appear in that layer's order()."""
        keys = [(layer, e) for layer, c in self.counts.items() for e in range(len(c))]
        return sorted(keys, key=lambda k: (-self.counts[k[0]][k[1]], k))

    def check(self, manifest: Manifest, path: Path | str) -> HotProfile:
        """Self, if it was measured on this conversion and covers its MoE layers' experts; else a
        ManifestError naming the file."""
        self._same_conversion(manifest.exact_sha256(), path)
        n = manifest.args.n_routed_experts
        wrong = [layer for layer, c in self.counts.items() if layer not in manifest.experts or len(c) != n]
        if wrong:
            raise ManifestError(
                f"{path}: layer {wrong[0]} is not a MoE layer of {n} experts in this model; the file was edited "
                f"or damaged, run `dsfp4 profile-hot` again"
            )
        return self

    def _same_conversion(self, conversion: str, path: Path | str) -> None:
        if self.conversion != conversion:
            raise ManifestError(
                f"{path} was measured on another model or conversion (conversion {self.conversion[:12]}, "
                f"this model is {conversion[:12]}); profile this model with `dsfp4 profile-hot`, or remove the file"
            )

    def merge(self, other: HotProfile, path: Path | str) -> HotProfile:
        """Both profiles' counts and weights added up (`other` read from `path`, named in errors)."""
        other._same_conversion(self.conversion, path)
        shape = {layer: len(c) for layer, c in self.counts.items()}
        if {layer: len(c) for layer, c in other.counts.items()} != shape:
            raise ManifestError(f"{path}: its layers or experts differ from the profile it is merged into")
        # weights are summed where both profiles have them
        both = set(self.weights) & set(other.weights)
        return HotProfile(
            self.conversion,
            self.tokens + other.tokens,
            {k: tuple(a + b for a, b in zip(c, other.counts[k], strict=True)) for k, c in self.counts.items()},
            {k: tuple(a + b for a, b in zip(self.weights[k], other.weights[k], strict=True)) for k in sorted(both)},
            self.sources + other.sources,
        )

    def to_json(self) -> bytes:
        layers = {}
        for layer, c in sorted(self.counts.items()):
            entry: dict = {"counts": list(c)}
            if layer in self.weights:
                entry["weights"] = [round(w, 6) for w in self.weights[layer]]
            entry["order"] = self.order(layer)
            layers[str(layer)] = entry
        d = {
            "format": HOT_FORMAT,
            "conversion_sha256": self.conversion,
            "tokens": self.tokens,
            "sources": list(self.sources),
            "layers": layers,
        }
        return (json.dumps(d) + "\n").encode()

    def write(self, path: Path) -> None:
        atomic_write_bytes(Path(path), self.to_json())

    @classmethod
    def read(cls, path: Path) -> HotProfile:
        path = Path(path)
        try:
            d = json.loads(path.read_bytes())
            if not isinstance(d, dict) or d.get("format") != HOT_FORMAT:
                raise ManifestError(f"{path}: not a {HOT_FORMAT} profile; run `dsfp4 profile-hot` again")
            layers = {int(k): v for k, v in d["layers"].items()}
            counts = {k: tuple(int(x) for x in v["counts"]) for k, v in layers.items()}
            weights = {k: tuple(float(x) for x in v["weights"]) for k, v in layers.items() if "weights" in v}
            if any(x < 0 for c in counts.values() for x in c) or any(
                len(w) != len(counts[k]) for k, w in weights.items()
            ):
                raise ValueError("negative counts, or weights that do not match the counts")
            return cls(str(d["conversion_sha256"]), int(d["tokens"]), counts, weights, tuple(map(str, d["sources"])))
        except OSError as e:
            raise ManifestError(f"{path}: cannot read the hot profile ({e.strerror or e})") from e
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(f"{path}: malformed hot profile ({e}); run `dsfp4 profile-hot` again") from e
