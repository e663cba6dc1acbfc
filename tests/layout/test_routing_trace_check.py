"""A routing trace is what a router gives: k distinct experts per token and layer, finite weights >= 0; any other
trace is refused when read, in one line naming the file, the token and the layer."""

from __future__ import annotations

import numpy as np
import pytest

from dsfp4.errors import ConfigError
from dsfp4.layout.routing_trace import RoutingTrace, check_top_k, read_trace, write_trace
from tests.fixtures.cli import assert_one_line_error, run_cli


def _ids(tokens: int = 4, layers: int = 3) -> np.ndarray:
    # [tokens, layers, 2]: experts 2 and 5 everywhere
    return np.tile(np.array([2, 5], dtype=np.int32), (tokens, layers, 1))


@pytest.mark.parametrize("suffix", [".npy", ".npz"])
def test_an_expert_twice_in_one_tokens_top_k_is_refused(tmp_path, suffix):
    ids = _ids()
    ids[3, 1] = [4, 4]
    write_trace(tmp_path / f"t{suffix}", RoutingTrace(ids))
    with pytest.raises(ConfigError, match=f"t{suffix}: token 3 lists expert 4 twice in its top-k at trace layer 1"):
        read_trace(tmp_path / f"t{suffix}")
    with pytest.raises(ConfigError, match="twice"):
        check_top_k(ids)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -0.5])
def test_weights_that_are_not_finite_or_are_negative_are_refused(tmp_path, bad):
    weights = np.full(_ids().shape, 1.25, dtype=np.float32)
    weights[2, 0, 1] = bad
    write_trace(tmp_path / "t.npz", RoutingTrace(_ids(), weights))
    with pytest.raises(ConfigError, match="'weights' of token 2, trace layer 0, choice 1 is .*finite and >= 0"):
        read_trace(tmp_path / "t.npz")


def test_integer_weights_are_refused(tmp_path):
    write_trace(tmp_path / "t.npz", RoutingTrace(_ids(), np.ones(_ids().shape, dtype=np.int32)))
    with pytest.raises(ConfigError, match="expected float routing weights"):
        read_trace(tmp_path / "t.npz")


def test_run_refuses_a_trace_with_nan_weights_in_one_line(converted, tmp_path):
    weights = np.full(_ids(layers=2).shape, np.nan, dtype=np.float32)
    write_trace(tmp_path / "nan.npz", RoutingTrace(_ids(layers=2), weights))
    r = run_cli("run", converted, "--prompt", "hi", "--device", "cpu", "-q", "--routing", tmp_path / "nan.npz")
    assert_one_line_error(r, "nan.npz", "finite and >= 0")
