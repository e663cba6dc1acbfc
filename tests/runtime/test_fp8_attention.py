"""run --fp8-attention (the lossy FP8 prefill attention, kernels/mla/prefill.py fp8) end to end: a long prompt's
logits move and only where the decompressed form runs, the cards and families without it are refused before
anything loads, and saved prompt caches keep the two apart."""

from __future__ import annotations

import pytest
import torch

from dsfp4.errors import ConfigError
from dsfp4.kernels.token_bounds import DECOMPRESS_TOKENS
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.models.load import run_target
from dsfp4.runtime.options import RunOptions

# past DECOMPRESS_TOKENS: the prompt's one chunk attends in the decompressed form
LONG = "The expert store keeps the hottest records on the device and the rest in RAM, " * 3


def _logits(model, fp8: bool, text: str) -> torch.Tensor:
    with Engine(model, device="cpu", max_context=256, fp8_attention=fp8) as e:
        ids = e.encode(text)
        return e.logits(ids), len(ids)


def test_the_run_plans_the_fp8_attentions_copies(converted):
    """The flag reaches the planner: the workspace holds the e4m3 copies (layout/family.py)."""
    spaces = []
    for fp8 in (False, True):
        with Engine(converted, device="cpu", max_context=256, fp8_attention=fp8) as e:
            spaces.append(e.plan.workspace)
    assert spaces[1] > spaces[0]


def test_fp8_attention_moves_a_long_prompts_logits_a_little_and_a_short_ones_not_at_all(converted):
    exact, n = _logits(converted, False, LONG)
    fp8, _ = _logits(converted, True, LONG)
    assert n > DECOMPRESS_TOKENS
    err = (fp8 - exact).abs().max() / exact.abs().max()
    # e4m3 keeps 3 mantissa bits: the logits move (on this random model, whose near-uniform attention passes the
    # roundings through every layer, by up to half their range; on the trained small DeepSeek KL 0.005, README)
    assert 0 < err < 0.6
    short, m = _logits(converted, False, "Once upon a time")
    short_fp8, _ = _logits(converted, True, "Once upon a time")
    assert m <= DECOMPRESS_TOKENS and torch.equal(short, short_fp8)  # the absorbed form: exact


def test_a_family_without_fp8_attention_is_refused_before_loading(v4_converted):
    with pytest.raises(ConfigError, match="--fp8-attention: .* DeepSeek-V4, whose attention has no FP8 variant"):
        run_target(v4_converted, RunOptions(device="cpu", fp8_attention=True))


def test_a_card_without_fp8_tensor_cores_is_refused_before_loading(converted, monkeypatch):
    from dsfp4.runtime.models import load

    monkeypatch.setattr(load, "resolve_device", lambda name: torch.device("cuda", 0))
    monkeypatch.setattr(load, "kernel_paths", _paths_of((8, 6)))
    monkeypatch.setattr(load, "fp8_kernel_runs", lambda card: False)
    with pytest.raises(ConfigError, match=r"cuda:0 \(sm_86\) has no FP8 tensor cores"):
        run_target(converted, RunOptions(device="cuda", fp8_attention=True))
    # ROCm: the reason is that no NVIDIA kernel runs there, not the card's number
    monkeypatch.setattr(torch.version, "hip", "6.2")
    with pytest.raises(ConfigError, match=r"cuda:0 is a ROCm card, where dsfp4's Triton kernels do not run"):
        run_target(converted, RunOptions(device="cuda", fp8_attention=True))


def _paths_of(capability: tuple[int, int]):
    class Paths:
        def __init__(self, card):
            self.capability = capability

        def check(self) -> None:
            pass

    return Paths


def test_saved_prompt_caches_of_the_two_attentions_stay_apart(tmp_path):
    from dsfp4.runtime.generate.prompt_reuse import open_prompt_cache

    class Model:
        def positional_caches(self):
            return {"kv": torch.zeros(1, 8, 4)}

    exact, fp8 = (open_prompt_cache(Model(), tmp_path, tmp_path / "pc", "1G", "c0", f).identity for f in (False, True))
    assert exact == {"conversion": "c0", "rows": {"kv": [[8, 4], "torch.float32"]}}  # as before the lever
    assert fp8 == exact | {"attention": "fp8"}
