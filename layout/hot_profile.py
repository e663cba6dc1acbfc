"""hot.json: how often each routed expert was chosen, per MoE layer, measured by `dsfp4 profile-hot`.

The runtime warm-starts its tiers from it (the hottest records go to the GPU, the next to RAM). A
profile belongs to one conversion (the manifest's sha256): another conversion may order or name its
experts differently, so a foreign profile is set aside with a note rather than trusted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dsfp4.errors import ManifestError
from dsfp4.layout.atomic import atomic_write_bytes

HOT_NAME = "hot.json"
HOT_FORMAT = "dsfp4-hot-1"


@dataclass(frozen=True)
class HotProfile:
    manifest_sha256: str
    tokens: int
    counts: dict[int, tuple[int, ...]]  # MoE layer -> times each expert was chosen

    def ranked(self) -> list[tuple[int, int]]:
        """(layer, expert) keys, hottest first across layers (every layer saw the same tokens); ties in
        file order."""
        keys = [(layer, e) for layer, c in self.counts.items() for e in range(len(c))]
        return sorted(keys, key=lambda k: (-self.counts[k[0]][k[1]], k))

    def to_json(self) -> bytes:
        d = {
            "format": HOT_FORMAT,
            "manifest_sha256": self.manifest_sha256,
            "tokens": self.tokens,
            "layers": {str(layer): list(c) for layer, c in sorted(self.counts.items())},
        }
        return (json.dumps(d) + "\n").encode()

    def write(self, model_dir: Path) -> None:
        atomic_write_bytes(Path(model_dir) / HOT_NAME, self.to_json())

    @classmethod
    def read(cls, path: Path) -> HotProfile:
        try:
            d = json.loads(Path(path).read_bytes())
            if d.get("format") != HOT_FORMAT:
                raise ManifestError(f"{path}: not a {HOT_FORMAT} profile; run `dsfp4 profile-hot` again")
            counts = {int(k): tuple(int(x) for x in v) for k, v in d["layers"].items()}
            if any(x < 0 for c in counts.values() for x in c):
                raise ValueError("negative count")
            return cls(str(d["manifest_sha256"]), int(d["tokens"]), counts)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(f"{path}: malformed hot profile ({e}); run `dsfp4 profile-hot` again") from e
