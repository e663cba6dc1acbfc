"""A Hugging Face checkpoint folder opened for streaming: config, index, shard headers, one tensor at a time.

Every tensor is resolved through the index's weight_map (a weight and its scale may sit in different
shards). All shards are opened and their headers validated up front, so a missing or truncated shard
fails before any output is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from dsfp4.convert.names.family import name_map
from dsfp4.convert.source.hf_config import from_hf_config
from dsfp4.errors import SourceError
from dsfp4.hub.download import Selection
from dsfp4.layout.model_args import ModelArgs
from dsfp4.layout.safetensors_file import TensorInfo, bytes_to_tensor, pread_exact, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files copied next to the converted model when the source has them.
AUX_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


# the checkpoints the converter takes, and their files that it reads (top-level files only)
KNOWN_REPOS = (
    "deepseek-ai/DeepSeek-V3",
    "deepseek-ai/DeepSeek-R1",
    "deepseek-ai/DeepSeek-V3-0324",
    "deepseek-ai/DeepSeek-R1-0528",
    "deepseek-ai/DeepSeek-V3.1",
    "nvidia/DeepSeek-R1-FP4",
)
SOURCE_FILES = ("*.safetensors", INDEX_NAME, *AUX_FILES)


def source_selection(include: tuple[str, ...] = (), no_mtp: bool = False) -> Selection:
    """What a download of a checkpoint takes: the files convert reads (or `include`'s); with no_mtp, not the
    shards that hold only the MTP layer (config.json and the index say which)."""
    if not no_mtp:
        return Selection(include or SOURCE_FILES, known_repos=KNOWN_REPOS)
    return Selection(
        include or SOURCE_FILES, ("config.json", INDEX_NAME), _mtp_shards, "MTP layer only, --no-mtp", KNOWN_REPOS
    )


def _mtp_shards(read: dict[str, dict]) -> list[str]:
    config, index = read["config.json"], read[INDEX_NAME]
    try:
        n, extra = int(config["num_hidden_layers"]), int(config.get("num_nextn_predict_layers", 0))
        return mtp_only_shards(dict(index["weight_map"]), config.get("model_type"), n, extra)
    except (KeyError, TypeError, ValueError) as e:
        raise SourceError(f"config.json or {INDEX_NAME} lacks what --no-mtp reads ({e})") from e


@dataclass(frozen=True)
class SourceTensor:
    shard: str
    info: TensorInfo


def mtp_only_shards(weight_map: dict[str, str], family: str, n_layers: int, n_mtp: int) -> list[str]:
    """Shards whose every tensor belongs to an MTP block (the family names them)."""
    mtp = name_map(family).mtp_prefixes(n_layers, n_mtp)
    keep = {shard for tensor, shard in weight_map.items() if not tensor.startswith(mtp)}
    return sorted(set(weight_map.values()) - keep)


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise SourceError(f"{path} not found: {what}")
    try:
        d = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(d, dict):
        raise SourceError(f"{path}: expected a JSON object")
    return d


class SourceCheckpoint:
    """Open with SourceCheckpoint(path); read tensors with read(name); close() when done."""

    def __init__(self, path: Path, no_mtp: bool = False, remote: dict[str, tuple[int, dict]] | None = None):
        """no_mtp: shards that hold only MTP-layer tensors may be missing (`dsfp4 download --no-mtp`).
        remote: shard -> (size, header) of shards not downloaded yet (`convert --from-hub`); they are
        opened when first read, after the caller has fetched them."""
        self.path = Path(path)
        self.remote = remote or {}
        self._lock = threading.Lock()
        if not self.path.is_dir():
            raise SourceError(f"{self.path}: not a folder; give the Hugging Face checkpoint folder")
        self.config = _read_json(self.path / "config.json", "is this a Hugging Face checkpoint folder?")
        self.args: ModelArgs = from_hf_config(self.config, str(self.path / "config.json"))
        self.quant_config = self._quant_config()
        weight_map = self._weight_map()
        self._fds: dict[str, int] = {}
        headers: dict[str, dict[str, TensorInfo]] = {}
        listed = sorted(set(weight_map.values()))
        a = self.args
        mtp = mtp_only_shards(weight_map, a.family, a.n_layers, a.n_mtp_layers) if no_mtp else []
        # left out on purpose (--no-mtp)
        self.absent = [s for s in mtp if not (self.path / s).is_file()]
        weight_map = {n: s for n, s in weight_map.items() if s not in self.absent}
        self.shards = [s for s in listed if s not in self.absent]
        try:
            for shard in self.shards:
                shard_path = self.path / shard
                if shard in self.remote:
                    headers[shard] = self.remote[shard][1]
                    continue
                if not shard_path.is_file():
                    hint = "" if no_mtp else " (if it holds only the MTP layer, convert with --no-mtp)"
                    raise SourceError(f"{shard_path} is listed in {INDEX_NAME} but missing; download it{hint}")
                headers[shard] = read_header(shard_path)
                self._fds[shard] = os.open(shard_path, os.O_RDONLY)
            self.tensors: dict[str, SourceTensor] = {}
            for name, shard in weight_map.items():
                if name not in headers[shard]:
                    raise SourceError(
                        f"tensor {name} is mapped to {shard} by {INDEX_NAME}, but that shard "
                        f"does not hold it; the download is inconsistent"
                    )
                self.tensors[name] = SourceTensor(shard, headers[shard][name])
            for shard, header in headers.items():
                if stray := sorted(set(header) - set(self.tensors)):
                    raise SourceError(
                        f"tensor {stray[0]} is in {shard} but not in {INDEX_NAME}; the download is inconsistent"
                    )
            self.nbytes = sum(t.info.nbytes for t in self.tensors.values())
            self.fingerprint = self._fingerprint()
        except BaseException:
            self.close()
            raise

    def _weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_NAME
        if index.is_file():
            d = _read_json(index, "")
            wm = d.get("weight_map") if isinstance(d, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise SourceError(f"{index}: no weight_map of tensor names to shard files; download it again")
            return wm
        single = self.path / SINGLE_NAME
        if single.is_file():
            return {name: SINGLE_NAME for name in read_header(single)}
        raise SourceError(f"{self.path}: neither {INDEX_NAME} nor {SINGLE_NAME} found; download the weights")

    def _quant_config(self) -> dict:
        """The declared quantization (fp8 from config.json, modelopt from hf_quant_config.json), or {}."""
        modelopt = self.path / "hf_quant_config.json"
        q = _read_json(modelopt, "").get("quantization") if modelopt.is_file() else None
        if q is None:
            q = self.config.get("quantization_config") or {}
        elif isinstance(q, dict):
            q = {"quant_method": "modelopt", **q}
        if not isinstance(q, dict):
            raise SourceError(f"{self.path}: the quantization settings are not a JSON object")
        return q

    def _fingerprint(self) -> str:
        """Identifies this source for resuming: config, index and every shard's name and size."""
        h = hashlib.sha256((self.path / "config.json").read_bytes())
        if (self.path / INDEX_NAME).is_file():
            h.update((self.path / INDEX_NAME).read_bytes())
        for shard in self.shards:
            size = self.remote[shard][0] if shard in self.remote else (self.path / shard).stat().st_size
            h.update(f"{shard}:{size}".encode())
        for shard in self.absent:
            h.update(f"{shard}:absent".encode())
        return h.hexdigest()

    def _fd(self, shard: str) -> int:
        # reader threads
        with self._lock:
            if shard not in self._fds:
                self._fds[shard] = os.open(self.path / shard, os.O_RDONLY)
            return self._fds[shard]

    def release(self, shard: str) -> None:
        """Close a shard every tensor of which has been read (before its file is deleted)."""
        with self._lock:
            if (fd := self._fds.pop(shard, None)) is not None:
                os.close(fd)

    def shards_of(self, names: Iterable[str]) -> set[str]:
        return {self.tensors[n].shard for n in names}

    def read_raw(self, name: str) -> torch.Tensor:
        """The stored bytes of one tensor as uint8."""
        t = self.tensors[name]
        return pread_exact(self._fd(t.shard), t.info.nbytes, t.info.offset, self.path / t.shard)

    def read(self, name: str) -> torch.Tensor:
        """One tensor, in its stored dtype, on the CPU."""
        t = self.tensors[name]
        return bytes_to_tensor(self.read_raw(name), t.info.dtype, t.info.shape)

    def fd_span(self, name: str) -> tuple[int, int, int]:
        """(fd, offset, nbytes) of a tensor, for chunked copies."""
        t = self.tensors[name]
        return self._fd(t.shard), t.info.offset, t.info.nbytes

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds = {}

    def __enter__(self) -> SourceCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
