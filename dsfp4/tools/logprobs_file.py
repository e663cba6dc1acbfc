"""The file `dsfp4 eval --save-logits` writes and `--reference` reads: per scored position of a text, the token
that came, its log-probability, and the k best log-probabilities with their ids; compressed with zstandard.

Layout (layout/framed_file.py): MAGIC, the header (FORMAT_VERSION, vocab size, k, the windows' contract, the scored
count), then one zstd frame of the arrays in ARRAYS order, each C-contiguous in its dtype: targets int32 [N],
target_logprob float32 [N], top_ids int32 [N, k], top_logprob float32 [N, k] (best first). encode and decode are
pure and inverse; read names the file in every error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsfp4.errors import ConfigError
from dsfp4.layout import framed_file
from dsfp4.layout.atomic import atomic_write_bytes

MAGIC = b"DSFP4LP\n"
FORMAT_VERSION = 1
# log-probabilities compress poorly; a middle level costs little time for the few percent it gains
ZSTD_LEVEL = 9
ARRAYS = (
    ("targets", np.int32, 1),
    ("target_logprob", np.float32, 1),
    ("top_ids", np.int32, 2),
    ("top_logprob", np.float32, 2),
)


@dataclass(frozen=True)
class LogProbs:
    """Scored positions of one evaluation, in the order they were scored."""

    targets: np.ndarray  # [N] int32: the text's token at each scored position
    target_logprob: np.ndarray  # [N] float32: its log-probability
    top_ids: np.ndarray  # [N, k] int32: the k most likely tokens, best first
    top_logprob: np.ndarray  # [N, k] float32: their log-probabilities

    def __post_init__(self) -> None:
        n = len(self.targets)
        for name, dtype, dims in ARRAYS:
            a = getattr(self, name)
            if a.dtype != dtype or a.ndim != dims or len(a) != n:
                raise ValueError(f"{name}: {a.dtype} {a.shape}, expected {np.dtype(dtype)} of {dims} dims, {n} rows")
        if self.top_ids.shape != self.top_logprob.shape:
            raise ValueError(f"top_ids {self.top_ids.shape} and top_logprob {self.top_logprob.shape} differ")

    @property
    def k(self) -> int:
        return self.top_ids.shape[1]


def encode(header: dict, lp: LogProbs) -> bytes:
    """header (JSON-able; FORMAT_VERSION, k and the count are added) and the arrays -> the file's bytes."""
    body = b"".join(np.ascontiguousarray(getattr(lp, name)).tobytes() for name, _, _ in ARRAYS)
    header = {**header, "k": lp.k, "positions": len(lp.targets)}
    return framed_file.pack(MAGIC, FORMAT_VERSION, header, body, ZSTD_LEVEL)


def decode(data: bytes) -> tuple[dict, LogProbs]:
    """The file's bytes -> (header, arrays); ValueError says what is wrong with them."""
    what = "a dsfp4 log-probabilities file (written by `dsfp4 eval --save-logits`)"
    header, _ = framed_file.unpack_header(MAGIC, FORMAT_VERSION, data, what)
    rows, k = int(header["positions"]), int(header["k"])
    header, body = framed_file.unpack(MAGIC, FORMAT_VERSION, data, what, rows * (8 + 8 * k) + 1)
    arrays, at = {}, 0
    for name, dtype, dims in ARRAYS:
        shape = (rows,) if dims == 1 else (rows, k)
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if at + size > len(body):
            raise ValueError(f"truncated data: {name} is cut short")
        arrays[name] = np.frombuffer(body, dtype=dtype, count=int(np.prod(shape)), offset=at).reshape(shape).copy()
        at += size
    if at != len(body):
        raise ValueError(f"{len(body) - at} bytes past the arrays")
    return header, LogProbs(**arrays)


def write(path: Path, header: dict, lp: LogProbs) -> None:
    """Write the file whole or not at all (a temporary file renamed into place)."""
    atomic_write_bytes(Path(path), encode(header, lp))


def read(path: Path) -> tuple[dict, LogProbs]:
    path = Path(path)
    try:
        return decode(path.read_bytes())
    except ValueError as e:
        raise ConfigError(
            f"{path}: {e}; write a reference with `dsfp4 eval MODEL --text FILE --save-logits OUT`"
        ) from e
