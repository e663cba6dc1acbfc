"""Top-k reduction (--experts-per-token K) on a routing trace: each token keeps its K heaviest choices at every layer,
as the router does when the run's shape routes it to K (runtime/models/load.py with_experts_per_token).

- A trace with weights (`dsfp4 run --record-trace`) lists a token's choices in the router's top-k order, which ranks
  by selection score (V3's carries the balancing bias), not by weight: its K heaviest are found by their weights.
- A calibrated trace holds ids only (scripts/synthetic_trace.py); its router model ranks a token's choices by score,
  best first (synthetic/routing_trace.py route), and that score stands for the weight: its first K are the K
  heaviest. An assumption: the bias can reorder a real router's choices against their weights.
Legend: N tokens, L MoE layers, K experts per token.
"""

from __future__ import annotations

import numpy as np

from dsfp4.errors import ConfigError


def _check(k: int, top_k: int, what: str) -> None:
    if not 1 <= k <= top_k:
        raise ConfigError(f"--experts-per-token {k}: {what} routes each token to {top_k} experts; give 1 to {top_k}")


def keep(ids: np.ndarray, k: int, weights: np.ndarray | None = None, what: str = "the trace") -> np.ndarray:
    """ids [N, L, K0] -> [N, L, k]: each token's k heaviest choices, heaviest first; by `weights` [N, L, K0] where the
    trace has them (the router's top-k order), else its first k (a calibrated trace, best first). 0 or K0: as it
    is."""
    if not k or k == ids.shape[-1]:
        return ids
    _check(k, ids.shape[-1], what)
    if weights is None:
        return ids[..., :k]
    order = np.argsort(-weights, axis=-1, kind="stable")[..., :k]  # [N, L, k]
    return np.take_along_axis(ids, order, -1)


def heaviest_weights(weights: np.ndarray, k: int) -> np.ndarray:
    """weights [N, L, K0] -> [N, L, k]: each token's k heaviest, heaviest first (0: all, as they are)."""
    return -np.sort(-weights, axis=-1)[..., :k] if k else weights


def same_drop(k: int, top_k: int, recorded_k: int) -> int:
    """The experts a token of a model routing to `recorded_k` keeps when it drops as many as k of top_k drops (the
    trained model's rates stand in for the whole model's by count: 7 of 8 reads as 5 of 6); 0: all."""
    if not k or k == top_k:
        return 0
    kept = recorded_k - (top_k - k)
    if kept < 1:
        raise ConfigError(
            f"--experts-per-token {k}: the recorded trace routes to {recorded_k} experts, too few to drop {top_k - k}"
        )
    return kept
