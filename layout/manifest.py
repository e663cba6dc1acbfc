"""manifest.json: the only channel from convert to runtime (layout versions 1 and 2).

Written last and atomically: a folder is a converted model exactly when its manifest exists. It holds the
model shape (ModelArgs), where every backbone tensor lives and in which format, a checksum per file, the
expert record layout and, per MoE layer, each expert's offset and checksum in its layer file.

Version 2 only adds per-layer cold record layouts (cold recipes, layout/recipe.py): a manifest is written as version 1
whenever version 1 can say what it holds (no cold records, or one cold layout of one width for every layer), so
readers of version 1 keep reading it; one they cannot read says version 2, which they refuse with "upgrade dsfp4".
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsfp4.errors import ChecksumError, ConfigError, FormatError, ManifestError
from dsfp4.layout.atomic import atomic_write_bytes
from dsfp4.layout.manifest_check import manifest_problem
from dsfp4.layout.manifest_schema import check_manifest
from dsfp4.layout.model_args import ModelArgs
from dsfp4.layout.recipe import MATRICES, ColdRecipe, recipe_of
from dsfp4.layout.record import RecordLayout
from dsfp4.value_types import kind
from dsfp4.version import __version__

MANIFEST_NAME = "manifest.json"
# the weight files besides the experts' (the tokenizer's and config's sit at the top)
BACKBONE_DIR = "backbone"
# the newest layout version this dsfp4 reads and writes; it reads every one from FIRST_VERSION
MANIFEST_VERSION = 2
FIRST_VERSION = 1
# what version 2 added: each layer's own cold record layout
PER_LAYER_VERSION = 2
CHECKSUM = "sha256"


@dataclass(frozen=True)
class TensorEntry:
    """A backbone weight: its file, format, logical shape and stored component tensor names."""

    file: str
    format: str
    shape: tuple[int, ...]
    tensors: dict[str, str]


@dataclass(frozen=True)
class FileEntry:
    nbytes: int
    sha256: str


@dataclass(frozen=True)
class ExpertFile:
    """One MoE layer's records: offsets[e] and sha256[e] belong to expert e. cold: the experts whose records are
    cold (in layout cold_record), source_sha256 (in cold's order) the sha256 of the records they were narrowed from."""

    file: str
    offsets: tuple[int, ...]
    sha256: tuple[str, ...]
    cold: tuple[int, ...] = ()
    source_sha256: tuple[str, ...] = ()
    # the layout of this layer's cold records (None when none is cold)
    cold_record: RecordLayout | None = None

    def to_dict(self, placed: bool = True, own_layout: bool = False) -> dict[str, Any]:
        """`placed` False: without where the records sit (file, offsets); `own_layout`: with cold_record (version 2)."""
        d: dict[str, Any] = {"file": self.file, "offsets": list(self.offsets)} if placed else {}
        d["sha256"] = list(self.sha256)
        if self.cold:
            d |= {"cold": list(self.cold), "source_sha256": list(self.source_sha256)}
            if own_layout:
                d["cold_record"] = self.cold_record.to_dict()
        return d

    @functools.cached_property
    def cold_set(self) -> frozenset[int]:
        """`cold` as a set: the store asks it on every read and upload."""
        return frozenset(self.cold)

    def exact(self) -> ExpertFile:
        """The layer as it was before its cold records were narrowed: each one's source checksum, none cold."""
        sha = list(self.sha256)
        for e, source in zip(self.cold, self.source_sha256, strict=True):
            sha[e] = source
        return ExpertFile(self.file, self.offsets, tuple(sha))


@dataclass(frozen=True)
class Manifest:
    args: ModelArgs
    source: dict[str, Any]
    options: dict[str, Any]
    tensors: dict[str, TensorEntry]
    files: dict[str, FileEntry]
    record: RecordLayout | None
    experts: dict[int, ExpertFile]
    skipped: dict[str, int] = field(default_factory=dict)
    quant_error: dict[str, float] = field(default_factory=dict)
    created_by: str = f"dsfp4 {__version__}"

    def file_position(self, key: tuple[int, int]) -> tuple[int, int]:
        """(layer, offset in its expert file) of the record of key (layer, expert): sorting records by it gives
        the order of sequential reads."""
        return key[0], self.experts[key[0]].offsets[key[1]]

    def layout_of(self, key: tuple[int, int]) -> RecordLayout:
        """The layout of the record of key (layer, expert): its layer's cold one, or the model's."""
        ef = self.experts[key[0]]
        return ef.cold_record if key[1] in ef.cold_set else self.record

    def cold_layouts(self, layers: Iterable[int] | None = None) -> dict[int, RecordLayout]:
        """layer -> the layout of its cold records, for those of `layers` (default: all) that have any."""
        keys = self.experts if layers is None else layers
        return {b: self.experts[b].cold_record for b in keys if self.experts[b].cold}

    def cold_nbytes(self, layers: Iterable[int] | None = None) -> int:
        """The largest cold record of `layers` (default: all), 0 when none is cold: what a slot for any must hold."""
        return max((c.nbytes for c in self.cold_layouts(layers).values()), default=0)

    def cold_recipe(self) -> ColdRecipe | None:
        """The recipe the cold records were narrowed by (layout/recipe.py), None when none is cold."""
        layouts = self.cold_layouts()
        return recipe_of({b: c.code_bits for b, c in layouts.items()}) if layouts else None

    def routed_bits(self, layers: Iterable[int] | None = None) -> float:
        """Bits per routed weight as stored, scales included: the records' bytes of `layers` (default: all) over their
        3 x D x I weights each."""
        rec, keys = self.record, sorted(self.experts if layers is None else layers)
        nbytes = sum(self.layout_of((b, e)).nbytes for b in keys for e in range(len(self.experts[b].offsets)))
        weights = sum(len(self.experts[b].offsets) for b in keys) * len(MATRICES) * rec.dim * rec.inter_dim
        return 8 * nbytes / weights if weights else 0.0

    @property
    def version(self) -> int:
        """The layout version that can say what this manifest holds (module docstring)."""
        layouts = {c for c in self.cold_layouts().values() if c is not None}
        shared = len(layouts) <= 1 and all(c.uniform for c in layouts)
        return FIRST_VERSION if shared else PER_LAYER_VERSION

    def record_end(self, key: tuple[int, int]) -> int:
        """Where the record of key ends in its layer file."""
        return self.file_position(key)[1] + self.layout_of(key).nbytes

    def to_dict(self) -> dict[str, Any]:
        version, layouts = self.version, self.cold_layouts()
        own = version >= PER_LAYER_VERSION
        shared = next(iter(layouts.values())) if layouts and not own else None
        return {
            "format_version": version,
            "created_by": self.created_by,
            "checksum": CHECKSUM,
            "model": self.args.to_dict(),
            "source": self.source,
            "options": self.options,
            "tensors": {
                k: {"file": t.file, "format": t.format, "shape": list(t.shape), "tensors": t.tensors}
                for k, t in self.tensors.items()
            },
            "files": {k: {"nbytes": f.nbytes, "sha256": f.sha256} for k, f in self.files.items()},
            "experts": {
                "record": self.record.to_dict() if self.record else None,
                **({"cold_record": shared.to_dict()} if shared else {}),
                "layers": {str(layer): e.to_dict(own_layout=own) for layer, e in self.experts.items()},
            },
            "skipped": self.skipped,
            "quant_error": self.quant_error,
        }

    def to_json(self) -> bytes:
        return (json.dumps(self.to_dict(), indent=1) + "\n").encode()

    def conversion_sha256(self) -> str:
        """Identity of this conversion, which prompt caches and exports bind to: the manifest without where the
        records sit (each layer's file and offsets), the one thing a hot-first repack changes."""
        d = self.to_dict()
        own = self.version >= PER_LAYER_VERSION
        d["experts"]["layers"] = {k: e.to_dict(placed=False, own_layout=own) for k, e in self.experts.items()}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    def exact_sha256(self) -> str:
        """Identity of the conversion before its cold records were narrowed (conversion_sha256 when none is):
        hot profiles bind to it, since the experts a router picks are the same conversion's, narrowed or not."""
        exact = dataclasses.replace(self, experts={k: e.exact() for k, e in self.experts.items()})
        return exact.conversion_sha256()

    def write(self, out_dir: Path) -> None:
        atomic_write_bytes(out_dir / MANIFEST_NAME, self.to_json())

    def backbone_files(self) -> list[str]:
        """The weight files besides the experts' (paths relative to the model folder)."""
        return [rel for rel in self.files if rel.startswith(BACKBONE_DIR + "/")]

    def check_files(self, model_dir: Path) -> None:
        """Every weight file (backbone/) is in `model_dir` at its size and each expert file holds its records and
        nothing past them (a stat per file: a truncated or missing file fails when the model is opened, not when it is
        first read). The tokenizer's and config's files are left to their parsers and to verify: a user may edit the
        chat template."""
        sizes = [(rel, self.files[rel].nbytes, "") for rel in self.backbone_files()]
        sizes += [
            (
                e.file,
                max((self.record_end((b, k)) for k in range(len(e.offsets))), default=0),
                f" (experts of layer {b})",
            )
            for b, e in self.experts.items()
        ]
        for rel, want, what in sizes:
            path = Path(model_dir) / rel
            if not path.is_file():
                raise ChecksumError(f"{path}{what} is listed in the manifest but missing; convert again")
            # an expert file ends where its last record does: bytes past it were added by something else
            if (have := path.stat().st_size) != want:
                how = "truncated" if have < want else f"{have - want} bytes longer than the manifest's records"
                raise ChecksumError(
                    f"{path}{what}: {have} bytes, the manifest says {want}; the file is {how}, convert again"
                )

    @classmethod
    def open(cls, model_dir: Path) -> Manifest:
        """The manifest of a converted model whose files are all there at their sizes (read, then check_files)."""
        m = cls.read(model_dir)
        m.check_files(Path(model_dir))
        return m

    @classmethod
    def read(cls, model_dir: Path) -> Manifest:
        path = Path(model_dir) / MANIFEST_NAME
        if not path.is_file():
            raise ManifestError(
                f"{path} not found: {model_dir} is not a converted model "
                f"(run `dsfp4 convert --fp4 SRC {model_dir}` first)"
            )
        try:
            d = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(f"{path}: not valid JSON ({e}); convert again") from e
        if not isinstance(d, dict):
            raise ManifestError(f"{path}: malformed manifest ({kind(d)}, not an object); convert again")
        version = d.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool):
            what = f"is {json.dumps(version)} ({kind(version)}), not a number" if "format_version" in d else "missing"
            raise ManifestError(
                f"{path}: format_version {what} (this dsfp4 reads layout version {MANIFEST_VERSION}); convert the "
                "model again with this dsfp4"
            )
        if not FIRST_VERSION <= version <= MANIFEST_VERSION:
            newer = version > MANIFEST_VERSION
            fix = "upgrade dsfp4" if newer else "convert the model again with this dsfp4"
            reads = f"{FIRST_VERSION} to {MANIFEST_VERSION}"
            raise ManifestError(f"{path}: layout version {version}, this dsfp4 reads {reads}: {fix}")
        if (wrong := check_manifest(d)) is not None:
            raise ManifestError(f"{path}: malformed manifest at {wrong}; convert again")
        try:
            ex = d["experts"]
            shared = RecordLayout.from_dict(ex["cold_record"]) if ex.get("cold_record") else None
            m = cls(
                args=ModelArgs.from_dict(d["model"]),
                source=d["source"],
                options=d["options"],
                tensors={
                    k: TensorEntry(t["file"], t["format"], tuple(t["shape"]), t["tensors"])
                    for k, t in d["tensors"].items()
                },
                files={k: FileEntry(f["nbytes"], f["sha256"]) for k, f in d["files"].items()},
                record=RecordLayout.from_dict(ex["record"]) if ex["record"] else None,
                experts={int(k): _expert_file(e, shared) for k, e in ex["layers"].items()},
                skipped=d.get("skipped", {}),
                quant_error=d.get("quant_error", {}),
                created_by=d.get("created_by", "?"),
            )
        except (KeyError, TypeError, ConfigError, FormatError) as e:
            raise ManifestError(f"{path}: malformed manifest ({e}); convert again") from e
        if (problem := manifest_problem(m)) is not None:
            raise ManifestError(f"{path}: {problem}; convert again")
        if m.version != version:
            raise ManifestError(
                f"{path}: format_version {version}, but what it holds is layout version {m.version}'s; convert again"
            )
        return m


def _expert_file(e: dict[str, Any], shared: RecordLayout | None) -> ExpertFile:
    """One layer's entry: its cold records in its own layout (version 2) or in experts.cold_record (version 1)."""
    cold = tuple(map(int, e.get("cold", ())))
    own = RecordLayout.from_dict(e["cold_record"]) if e.get("cold_record") else shared
    return ExpertFile(
        e["file"],
        tuple(e["offsets"]),
        tuple(e["sha256"]),
        cold,
        tuple(map(str, e.get("source_sha256", ()))),
        own if cold else None,
    )
