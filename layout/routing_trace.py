"""Routing traces: the experts each MoE layer chose for each token, in the order the tokens were computed.

Written by `dsfp4 run --record-trace` and `dsfp4 profile-hot --trace`, read by the replay tool
(scripts/replay_trace.py). Two forms, chosen by the file's suffix:

  .npy  ids only: int32 [tokens, layers, top_k]
  .npz  ids        int32   [tokens, layers, top_k]   expert ids, in the router's top-k order
        weights    float32 [tokens, layers, top_k]   their routing weights (after route_scale)
        layers     int32   [layers]                  the model's layer number of each MoE layer
        tokens     int64   [tokens]                  the token ids (absent when unknown)
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsfp4.errors import ConfigError
from dsfp4.layout.atomic import atomic_write_bytes
from dsfp4.layout.trace_path import check_trace_path


@dataclass(frozen=True)
class RoutingTrace:
    ids: np.ndarray  # [tokens, layers, top_k]
    weights: np.ndarray | None = None  # [tokens, layers, top_k]
    layers: np.ndarray | None = None  # [layers]
    tokens: np.ndarray | None = None  # [tokens]


def check_ids(ids: np.ndarray, what: str = "trace") -> np.ndarray:
    """The ids as int64 [tokens, layers, top_k], or ConfigError naming `what` and the fault."""
    ids = np.asarray(ids)
    if ids.ndim != 3 or 0 in ids.shape:
        raise ConfigError(f"{what}: expected a non-empty [tokens, layers, top_k] array, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(f"{what}: expected integer expert ids, got dtype {ids.dtype}")
    if ids.min() < 0:
        raise ConfigError(f"{what}: expert ids must be >= 0, found {int(ids.min())}")
    return ids.astype(np.int64, copy=False)


def check_top_k(ids: np.ndarray, what: str = "trace") -> np.ndarray:
    """A token trace's ids (check_ids') as a router gives them: k different experts per token and layer (a replay's
    steps, which merge tokens, may repeat one; a token's top-k may not)."""
    ordered = np.sort(ids, axis=-1)
    if (twice := np.argwhere(ordered[..., 1:] == ordered[..., :-1])).size:
        t, layer, k = (int(i) for i in twice[0])
        raise ConfigError(
            f"{what}: token {t} lists expert {int(ordered[t, layer, k])} twice in its top-k at trace layer {layer}; "
            "each token's experts at a layer are distinct"
        )
    return ids


def check_weights(weights: np.ndarray, what: str = "trace") -> np.ndarray:
    """Routing weights as they are (finite numbers >= 0, as every router gives), or ConfigError naming the first
    that is not."""
    if not np.issubdtype(weights.dtype, np.floating):
        raise ConfigError(f"{what}: expected float routing weights, got dtype {weights.dtype}")
    if (bad := np.argwhere(~np.isfinite(weights) | (weights < 0))).size:
        t, layer, k = (int(i) for i in bad[0])
        raise ConfigError(
            f"{what}: 'weights' of token {t}, trace layer {layer}, choice {k} is {weights[t, layer, k]}; routing "
            "weights are finite and >= 0"
        )
    return weights


def write_trace(path: Path, trace: RoutingTrace) -> None:
    """Write atomically (a reader never sees half a trace)."""
    path = check_trace_path(path)
    buf = io.BytesIO()
    ids = trace.ids.astype(np.int32)
    if path.suffix == ".npy":
        np.save(buf, ids)
    else:
        parts = {"ids": ids, "weights": trace.weights, "layers": trace.layers, "tokens": trace.tokens}
        np.savez_compressed(buf, **{k: v for k, v in parts.items() if v is not None})
    atomic_write_bytes(path, buf.getvalue())


def _shaped(data: np.lib.npyio.NpzFile, key: str, shape: tuple[int, ...], path: Path) -> np.ndarray | None:
    if key not in data.files:
        return None
    value = data[key]
    if value.shape != shape:
        raise ConfigError(f"{path}: '{key}' has shape {value.shape}, the ids need {shape}")
    return value


def read_trace(path: Path) -> RoutingTrace:
    """A trace from .npy (ids) or .npz (ids and what else it holds). ConfigError names the file."""
    path = Path(path)
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ConfigError(f"{path}: cannot read a routing trace ({e})") from e
    if isinstance(data, np.ndarray):
        return RoutingTrace(check_top_k(check_ids(data, str(path)), str(path)))
    with data:
        if "ids" not in data.files:
            raise ConfigError(f"{path}: an .npz routing trace needs an 'ids' array, found {sorted(data.files)}")
        ids = check_top_k(check_ids(data["ids"], str(path)), str(path))
        weights = _shaped(data, "weights", ids.shape, path)
        return RoutingTrace(
            ids,
            None if weights is None else check_weights(weights, str(path)),
            _shaped(data, "layers", ids.shape[1:2], path),
            _shaped(data, "tokens", ids.shape[:1], path),
        )
