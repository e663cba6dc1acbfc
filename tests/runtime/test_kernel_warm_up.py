"""The backbone's kernels compiled at start (runtime/models/kernel_warm_up.py): one call per variant a prompt can
take, and on a GPU no request compiling anything afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsfp4.kernels.token_bounds import DECOMPRESS_TOKENS
from dsfp4.runtime.models.kernel_warm_up import SPECIALIZED_DIVISOR, prompt_sizes


def _key(variant, t: int) -> tuple:
    return variant(t), t > DECOMPRESS_TOKENS, t % SPECIALIZED_DIVISOR == 0


@pytest.mark.parametrize("chunk", [1, 16, 33, 200, 512])
def test_prompt_sizes_cover_every_variant_once(chunk):
    # a GEMV per count up to 16, then tiles that widen at 128 tokens for one matrix and 300 for another
    def variant(t: int):
        return t if t <= 16 else (t >= 128, t >= 300)

    sizes = prompt_sizes(chunk, variant)
    keys = [_key(variant, t) for t in sizes]
    assert len(set(keys)) == len(keys), "one call per variant"
    assert {_key(variant, t) for t in range(1, chunk + 1)} == set(keys), "every variant of 1..chunk called"
    # the smallest of each, so a warm-up's calls stay short
    smallest = {k: min(t for t in range(1, chunk + 1) if _key(variant, t) == k) for k in keys}
    assert [smallest[k] for k in keys] == sizes
    assert sizes == sorted(sizes) and sizes[-1] <= chunk


def test_warm_up_compiles_nothing_where_no_kernel_runs(converted):
    from dsfp4.runtime.engine import Engine
    from dsfp4.runtime.models.kernel_warm_up import warm_up_backbone

    with Engine(converted, device="cpu", max_context=64) as engine:
        assert warm_up_backbone(engine.model, 32) == 0


FIRST_REQUESTS = """
import dataclasses, json, sys
from pathlib import Path
import torch
from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.models.load import plan_run
from dsfp4.runtime.options import RunOptions

def entries():
    return sorted(str(p.relative_to(cache)) for p in cache.glob("*/*.json") if not p.name.startswith("__grp__"))

cache, cuda = Path(sys.argv[2]), torch.device("cuda")
options, plan = RunOptions(device="cuda", max_context=600, prefill_chunk=128), None
if sys.argv[3] == "streamed":
    # fewer device slots than records: the prompts' waves take compacted calls
    plan = plan_run(Manifest.read(sys.argv[1]), cuda, options.torch_dtype(cuda), 600, options, False)
    plan = dataclasses.replace(plan, gpu_slots=3, ram_slots=5, staging=4)
with Engine(sys.argv[1], options, plan=plan) as engine:
    started = entries()
    for n in (3, 20, 40, 100, 128, 300, 517):
        engine.generate([5 + i % 50 for i in range(n)], max_tokens=2, temperature=0)
    print(json.dumps({"started": started, "after": entries()}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["resident", "streamed"])
def test_no_request_compiles_after_the_engine_starts(converted, tmp_path, experts):
    """A fresh Triton cache: every kernel a prompt of any length takes was compiled while the engine started, with
    every expert on the card and with experts streamed through 3 slots (kernels/moe/waves.py's calls)."""
    cache = tmp_path / "triton"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", FIRST_REQUESTS, str(converted), str(cache), experts],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["started"], "the engine's start compiled the kernels"
    assert sorted(set(seen["after"]) - set(seen["started"])) == []


@pytest.mark.parametrize("family", ["v3", "v4"])
def test_the_warm_up_runs_every_call_and_changes_no_answer(converted, v4_converted, monkeypatch, family):
    """The warm-up's calls through a V3 and a V4 model (on the CPU's references, as if kernels ran): one per size,
    and the cache rows they write change no later answer."""
    from dsfp4.runtime.engine import Engine
    from dsfp4.runtime.models import kernel_warm_up as warm

    model = converted if family == "v3" else v4_converted
    prompt = [5, 9, 11, 40, 7, 3, 8, 21, 13]
    with Engine(model, device="cpu", max_context=64) as engine:
        want = engine.generate(prompt, max_tokens=6, temperature=0).token_ids
        engine.reset()
        monkeypatch.setattr(warm, "use_kernels", lambda device: True)
        sizes = prompt_sizes(40, warm.backbone_variant(engine.model))
        assert warm.warm_up_backbone(engine.model, 40) == len(sizes) and sizes[:16] == list(range(1, 17))
        assert engine.generate(prompt, max_tokens=6, temperature=0).token_ids == want


@pytest.mark.parametrize("visible", [False, True])
def test_the_compacted_waves_variants_are_compiled_where_experts_stream(converted, monkeypatch, visible):
    """warm_up_waves (kernels/moe/waves.py) for each kernel, at the chunk, where MoE takes the store's waves; not where
    the store reaches every record itself (on a GPU, every record placed on the card or mapped at the warm start)."""
    from dsfp4.runtime import engine_setup
    from dsfp4.runtime.store.expert_store import ExpertStore
    from tests.runtime.test_expert_store import _engine

    calls = []
    monkeypatch.setattr(engine_setup, "warm_up_waves", lambda kernel, dtype, records, chunk: calls.append(chunk))
    with _engine(converted, 3, 5) as engine:
        calls.clear()
        monkeypatch.setattr(ExpertStore, "visible", property(lambda store: visible))
        engine_setup.warm_up_kernels(engine.model, torch.float32, engine.model.args, 40)
    assert calls == ([] if visible else [40])
