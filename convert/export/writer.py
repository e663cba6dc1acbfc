"""Writing an export: the converted model's tensors, under another checkpoint's names and config, as safetensors
shards (one per backbone file, one per MoE layer's experts), streamed one tensor at a time (the peak memory is one
tensor, whatever the model's size).

Each shard is written under a temporary name and renamed when whole; `model.safetensors.index.json` comes last, so
a folder is an export exactly when its index exists. What is read is checked (fidelity.py): the backbone's files before
OUT is touched and each record as it is read, against their sha256; cold records are refused unless accepted, then
labelled. A rerun keeps the shards already whole (their size in `.dsfp4-export.json`, with the conversion and format
they are of) and writes the rest.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from dsfp4.convert.export import compressed_tensors as ct
from dsfp4.convert.export import gguf, modelopt
from dsfp4.convert.export.fidelity import COLD_KEY, check_backbone, check_record, cold_label
from dsfp4.convert.family import source_family
from dsfp4.errors import ConfigError, OutputError
from dsfp4.layout.atomic import LOCK_NAME, atomic_write_bytes, lock_folder
from dsfp4.layout.manifest import MANIFEST_NAME, Manifest
from dsfp4.layout.output_path import writable_folder
from dsfp4.layout.safetensors_file import SafetensorsWriter, pread_exact
from dsfp4.units import format_bytes

INDEX = "model.safetensors.index.json"
PROGRESS = ".dsfp4-export.json"
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class Shard:
    name: str
    tensors: tuple[ct.OutTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


# the safetensors formats' matrix writers
MATRIX = {"compressed-tensors": ct._matrix, "modelopt": modelopt.matrix}


def plan_shards(model_dir: Path, manifest: Manifest, fmt: str = "compressed-tensors") -> list[Shard]:
    """Every shard of the `fmt` export, in order, with readers of the model's files (nothing is read yet)."""
    model_dir = Path(model_dir)

    @functools.lru_cache(maxsize=2)
    def opened(file: str):
        return safe_open(model_dir / file, framework="pt")

    def read(file: str, name: str) -> torch.Tensor:
        return opened(file).get_tensor(name)

    ct.check_fused(manifest, read)
    groups: dict[str, list[ct.OutTensor]] = {}
    for file, t in ct.backbone_tensors(manifest, read, MATRIX[fmt]):
        groups.setdefault(file, []).append(t)
    for layer in sorted(manifest.experts):
        records = _records(model_dir, manifest, layer)
        groups[f"experts-{layer:03d}"] = ct.expert_tensors(manifest, layer, records, MATRIX[fmt])
    n = len(groups)
    return [Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(ts)) for i, ts in enumerate(groups.values())]


def _records(model_dir: Path, manifest: Manifest, layer: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """record(e) -> the unpacked parts of expert e of `layer` (the last one read is kept: its tensors come in turn),
    checked against its sha256 as it is read."""
    entry = manifest.experts[layer]

    @functools.lru_cache(maxsize=1)
    def record(e: int) -> dict[str, torch.Tensor]:
        layout = manifest.layout_of((layer, e))
        fd = os.open(model_dir / entry.file, os.O_RDONLY)
        try:
            raw = check_record(
                pread_exact(fd, layout.nbytes, entry.offsets[e], model_dir / entry.file), manifest, model_dir, layer, e
            )
        finally:
            os.close(fd)
        # a cold record exported widened
        return manifest.record.unpack(layout.widen(raw) if layout.cold else raw)

    return record


def config(
    model_dir: Path, manifest: Manifest, fmt: str = "compressed-tensors", cold: dict | None = None
) -> tuple[dict, dict[str, dict]]:
    """(the model's config.json with the export's quantization_config, the other JSON files the format writes);
    `cold`: the label of widened cold records (fidelity.cold_label), kept in config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if cold is not None:
        cfg[COLD_KEY] = cold
    if fmt == "modelopt":
        cfg["quantization_config"], nested = modelopt.quantization_config(ct.matrices(manifest))
        return cfg, {modelopt.HF_QUANT_CONFIG: nested}
    cfg["quantization_config"] = ct.quantization_config(ct.matrices(manifest))
    return cfg, {}


def open_model(model_dir: Path) -> Manifest:
    """The converted model an export reads, or a one-line error for what no export format holds."""
    if not (model_dir / MANIFEST_NAME).is_file():
        raise ConfigError(f"{model_dir}: no {MANIFEST_NAME}; export takes a folder `dsfp4 convert` wrote")
    manifest = Manifest.open(model_dir)
    if manifest.record is None:
        raise ConfigError(f"{model_dir}: a model without routed experts has nothing this export format is for")
    if why := source_family(manifest.args).no_export:
        raise ConfigError(f"{model_dir}: {why}")
    return manifest


def check_out(out: Path) -> None:
    """OUT can be an export's folder: not a file, and where a folder can be written (before the model is read)."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"OUT {out}: a file, not a folder; choose a folder for the export")
    writable_folder(out, "OUT")


def _claim(out: Path, ours: tuple[str, ...]) -> int:
    """OUT made (or found holding an export's files) and locked: the lock's descriptor."""
    held = [p for p in out.iterdir() if p.name != LOCK_NAME] if out.exists() else []
    if held and not any((out / name).exists() for name in ours):
        raise OutputError(f"{out}: a folder that holds something other than an export; choose another OUT")
    out.mkdir(parents=True, exist_ok=True)
    return lock_folder(out, f"{out}: another export is writing this folder")


def export(
    model_dir: Path, out: Path, fmt: str, dry_run: bool = False, progress: bool = True, accept_cold: bool = False
) -> list[Shard]:
    """Write (or with dry_run only plan) the `fmt` export (compressed-tensors, modelopt) of the model at model_dir.
    `accept_cold`: cold records are exported widened and labelled, not refused."""
    model_dir, out = Path(model_dir), Path(out)
    if fmt not in MATRIX:
        raise ConfigError(f"--format {fmt}: export() writes {', '.join(MATRIX)}; GGUF is export_gguf's")
    if not dry_run:
        check_out(out)
    manifest = open_model(model_dir)
    ct.check_plain(manifest, model_dir)
    cold = cold_label(manifest, accept_cold, model_dir)
    # before planning: a format that cannot hold the model says so
    cfg, extra = config(model_dir, manifest, fmt, cold)
    shards = plan_shards(model_dir, manifest, fmt)
    if dry_run:
        return shards
    # before OUT is touched; the records are checked as they are read
    check_backbone(model_dir, manifest)
    fd = _claim(out, (PROGRESS, INDEX))
    try:
        identity = {"conversion": manifest.conversion_sha256(), "format": fmt}
        _write(model_dir, out, shards, cfg, extra, progress, identity)
    finally:
        os.close(fd)
    return shards


def export_gguf(
    model_dir: Path,
    out: Path,
    dry_run: bool = False,
    progress: bool = True,
    requantize: bool = False,
    accept_cold: bool = False,
) -> tuple[list[gguf.GTensor], dict[str, float]]:
    """Write (or with dry_run only plan) OUT/model.gguf: (its tensors, the requantization error by class).
    `requantize`: NVFP4 experts go to MXFP4 rather than being refused; `accept_cold`: cold records are exported
    widened and labelled, not refused."""
    model_dir, out = Path(model_dir), Path(out)
    if not dry_run:
        check_out(out)
    manifest = open_model(model_dir)
    cold = cold_label(manifest, accept_cold, model_dir)
    p = gguf.plan(model_dir, manifest, requantize, cold)
    if dry_run:
        return p.tensors, {}
    check_backbone(model_dir, manifest)
    fd = _claim(out, (gguf.FILE, gguf.FILE + ".partial", gguf.PROGRESS))
    try:
        total = sum(t.nbytes for t in p.tensors)
        with tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="export") as bar:
            gguf.write(out, manifest, p, bar)
    finally:
        os.close(fd)
    return p.tensors, p.stats.relative_rms()


def _write(
    model_dir: Path, out: Path, shards: list[Shard], cfg: dict, extra: dict[str, dict], progress: bool, identity: dict
) -> None:
    """identity: what the shards are of (the conversion, the format); shards of another are written again. `extra`:
    the format's other JSON files, by name."""
    done_path = out / PROGRESS
    done = json.loads(done_path.read_text()) if done_path.is_file() else {}
    if done.get("identity") != identity:
        done = {"identity": identity}
    total = sum(s.nbytes for s in shards)
    with tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="export") as bar:
        for shard in shards:
            path = out / shard.name
            record = done.get(shard.name)
            if record and path.is_file() and path.stat().st_size == record["nbytes"]:
                bar.update(shard.nbytes)
                continue
            tmp = path.with_name(path.name + ".partial")
            w = SafetensorsWriter(tmp, [(t.name, t.dtype, t.shape) for t in shard.tensors])
            try:
                for t in shard.tensors:
                    data = t.read()
                    if tuple(data.shape) != t.shape:
                        raise OutputError(f"{t.name}: read {list(data.shape)}, planned {list(t.shape)}")
                    w.write(t.name, data.contiguous())
                    bar.update(t.nbytes)
                w.close()
            except BaseException:
                w.abort()
                tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, path)
            # renamed into place whole: its size says so
            done[shard.name] = {"nbytes": path.stat().st_size}
            atomic_write_bytes(done_path, json.dumps(done, indent=1).encode())
    for name in COPIED:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out / name)
    for name, doc in {"config.json": cfg, **extra}.items():
        atomic_write_bytes(out / name, (json.dumps(doc, indent=1) + "\n").encode())
    weight_map = {t.name: s.name for s in shards for t in s.tensors}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write_bytes(out / INDEX, (json.dumps(index, indent=1) + "\n").encode())


def describe(shards: list[Shard]) -> str:
    """The dry run's table: each shard's tensors and size, then the total."""
    lines = [f"{s.name}  {len(s.tensors):6d} tensors  {format_bytes(s.nbytes):>10}" for s in shards]
    lines.append(f"total  {sum(len(s.tensors) for s in shards)} tensors, {format_bytes(sum(s.nbytes for s in shards))}")
    return "\n".join(lines)


def describe_gguf(tensors: list[gguf.GTensor]) -> str:
    """The dry run's table for GGUF: bytes by type, then the total."""
    by_type: dict[str, list[int]] = {}
    for t in tensors:
        row = by_type.setdefault(t.qtype.name, [0, 0])
        row[0], row[1] = row[0] + 1, row[1] + t.nbytes
    lines = [f"{name:<8}  {n:6d} tensors  {format_bytes(b):>10}" for name, (n, b) in sorted(by_type.items())]
    lines.append(f"{gguf.FILE}  {len(tensors)} tensors, {format_bytes(sum(t.nbytes for t in tensors))}")
    return "\n".join(lines)
