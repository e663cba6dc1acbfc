"""--experts-per-token K: each token takes its router's best K experts, weighted as the model weights its own top-k;
the run sees the model's shape with K (router, kernels, planner), so it equals the same model whose config says K."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from dsfp4.errors import ConfigError
from dsfp4.layout.manifest import MANIFEST_NAME
from dsfp4.runtime.engine import Engine
from tests.fixtures.cli import assert_one_line_error, run_cli

PROMPT = "Why is the sky blue? Because"


def _configured_with(converted, tmp_path, k: int):
    """The converted model with its manifest's shape routing each token to k experts (its files linked)."""
    out = tmp_path / f"k{k}"
    shutil.copytree(converted, out, copy_function=os.symlink)
    d = json.loads((out / MANIFEST_NAME).read_text())
    d["model"]["n_activated_experts"] = k
    (out / MANIFEST_NAME).unlink()
    (out / MANIFEST_NAME).write_text(json.dumps(d))
    return out


def test_fewer_experts_per_token_is_the_model_configured_with_fewer(converted, tmp_path):
    with Engine(converted, device="cpu", max_context=64, dtype="fp32") as exact:
        ids = exact.encode(PROMPT)
        full = exact.logits(ids)
    with Engine(converted, device="cpu", max_context=64, dtype="fp32", experts_per_token=2) as same:
        torch.testing.assert_close(same.logits(ids), full, rtol=0, atol=0)
    with Engine(converted, device="cpu", max_context=64, dtype="fp32", experts_per_token=1) as one:
        fewer = one.logits(ids)
        answer = one.generate(ids, max_tokens=4, temperature=0)
    with Engine(_configured_with(converted, tmp_path, 1), device="cpu", max_context=64, dtype="fp32") as configured:
        torch.testing.assert_close(fewer, configured.logits(ids), rtol=0, atol=0)
        assert configured.generate(ids, max_tokens=4, temperature=0).token_ids == answer.token_ids
    assert not torch.allclose(fewer, full)


def test_more_experts_than_the_model_routes_or_with_a_trace_is_refused(converted, tmp_path):
    with pytest.raises(ConfigError, match="routes each token to 2 experts; give 1 to 2"):
        Engine(converted, device="cpu", max_context=64, experts_per_token=3)
    trace = tmp_path / "t.npz"
    trace.write_bytes(b"")
    with pytest.raises(ConfigError, match="a trace fixes each token's experts"):
        Engine(converted, device="cpu", max_context=64, experts_per_token=1, routing=trace)


def test_v4s_hash_layers_refuse_it(v4_converted):
    with pytest.raises(ConfigError, match="route by a table of"):
        Engine(v4_converted, device="cpu", max_context=64, experts_per_token=1)


def test_the_plan_says_how_many_experts_a_token_takes(converted):
    r = run_cli("run", converted, "--plan", "--device", "cpu", "--experts-per-token", "1")
    assert r.exit_code == 0 and "; 1 routed experts per token" in r.stdout, r.output
    assert (
        json.loads(run_cli("run", converted, "--plan", "--json", "--experts-per-token", "1").stdout)["levers"][
            "experts_per_token"
        ]
        == 1
    )
    assert_one_line_error(run_cli("run", converted, "--plan", "--experts-per-token", "9"), "--experts-per-token 9")


def test_the_hot_profile_still_warms_the_tiers_and_prompt_caches_keep_to_their_count(converted, tmp_path):
    """hot.json binds to the conversion on disk, which fewer experts a token does not change; a prompt cache entry
    holds rows the count computed, so a run of another count does not take it."""
    from dsfp4.layout.hot_profile import HOT_NAME, HotProfile
    from dsfp4.layout.manifest import Manifest

    model = _configured_with(converted, tmp_path, 2)  # the model as converted, in a folder of its own
    m = Manifest.read(model)
    counts = {layer: tuple(range(m.args.n_routed_experts)) for layer in m.experts}
    HotProfile(m.exact_sha256(), 10, counts).write(model / HOT_NAME)
    prompt, cache = list(range(2, 80)), tmp_path / "pc"
    with Engine(model, device="cpu", max_context=128, experts_per_token=1, prompt_cache=cache) as one:
        assert one.model.experts.warm_records > 0
        one.generate(prompt, max_tokens=2, temperature=0)
    with Engine(model, device="cpu", max_context=128, prompt_cache=cache) as two:
        assert two.generate(prompt, max_tokens=2, temperature=0).stats.restored_tokens == 0
    with Engine(model, device="cpu", max_context=128, experts_per_token=1, prompt_cache=cache) as again:
        assert again.generate(prompt, max_tokens=2, temperature=0).stats.restored_tokens == len(prompt) - 1
