"""The mapped expert store: every record placed once (the hottest on the device, the rest in pinned RAM
read in place by the kernels), uses counted on the device, and on CUDA decode steps replayed as graphs
with the tokens of the other modes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from dsfp4.layout.hot_profile import HotProfile
from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.models.load import plan_run
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.store.expert_store import ExpertStore
from dsfp4.runtime.store.placement import hottest_first, map_all

CPU = torch.device("cpu")
PROMPT = "Explain the tiers of the expert store"


def _plan(model: Path, device: torch.device, gpu_slots: int, ram_slots: int):
    manifest = Manifest.read(model)
    plan = plan_run(manifest, device, torch.float32, 64, RunOptions(device=device.type), False)
    return dataclasses.replace(plan, gpu_slots=gpu_slots, ram_slots=ram_slots, staging=min(4, ram_slots))


def _record(store: ExpertStore, offset: int) -> bytes:
    """The bytes a kernel reads at `offset` from the device pool: a device slot, or a RAM slot in place."""
    n = store.layout.nbytes
    if 0 <= offset < store.gpu.numel():
        return store.gpu.view(-1)[offset : offset + n].cpu().numpy().tobytes()
    delta = store.ram.data_ptr() - store.gpu.data_ptr()
    assert (offset - delta) % n == 0
    return store.ram[(offset - delta) // n].numpy().tobytes()


def test_hottest_first_ranks_every_used_record_once_profile_first(converted):
    manifest = Manifest.read(converted)
    plan = _plan(converted, CPU, 3, 13)
    counts = {layer: tuple(range(8)) for layer in manifest.experts}  # expert 7 hottest in every layer
    profile = HotProfile(manifest.conversion_sha256(), 10, counts)
    order = hottest_first(manifest, plan, profile)
    used = {(layer, e) for layer in plan.expert_layers for e in range(8)}
    assert len(order) == len(used) and set(order) == used
    assert order[: len(plan.expert_layers)] == [(layer, 7) for layer in sorted(plan.expert_layers)]
    plain = hottest_first(manifest, plan, None)  # no profile: each layer's file order
    assert plain == sorted(used, key=lambda k: (k[0], manifest.experts[k[0]].offsets[k[1]]))


def test_map_all_places_every_record_once_where_its_offset_points(converted):
    manifest = Manifest.read(converted)
    truth = {
        (layer, e): (converted / ef.file).read_bytes()[off : off + manifest.record.nbytes]
        for layer, ef in manifest.experts.items()
        for e, off in enumerate(ef.offsets)
    }
    plan = _plan(converted, CPU, 3, 13)  # 16 records: 3 on the device, 13 in RAM
    store = ExpertStore(converted, manifest, CPU, plan)
    try:
        order = hottest_first(manifest, plan, None)
        map_all(store, order)
        assert store.mapped and store.visible and not store.all_resident
        res = store.residency()
        assert {k for k in order[:3]} == {(int(a), int(b)) for a, b in zip(*np.nonzero(res == 2), strict=True)}
        for layer in plan.expert_layers:
            offsets = store.offsets(layer).tolist()
            for e in range(manifest.args.n_routed_experts):
                assert _record(store, offsets[e]) == truth[(layer, e)], (layer, e)
        with pytest.raises(AssertionError, match="mapped store moves nothing"):
            next(store.load_waves(plan.expert_layers[0], [0]))
    finally:
        store.close()


def test_mapped_uses_are_counted_on_the_device_by_tier_and_dropped_when_uncounted(converted):
    manifest = Manifest.read(converted)
    plan = _plan(converted, CPU, 3, 13)
    store = ExpertStore(converted, manifest, CPU, plan)
    try:
        order = hottest_first(manifest, plan, None)
        map_all(store, order)
        layer = plan.expert_layers[0]
        on_device = {e for lay, e in order[:3] if lay == layer}
        ids = torch.tensor([[0, 1], [1, 5], [7, 0]])  # [T=3, K=2]
        before = store.counters.snapshot()
        store.count_step(layer, ids)
        store.count_step(layer, ids[:1])
        store.count_step(layer, torch.zeros(40, 2, dtype=torch.long))  # longer than any step before: a prefill
        store.count_step(layer, ids[:1])
        with store.uncounted():
            store.count_step(layer, ids)  # a graph's warm-up run: not a step of any generation
        store.count_resident([layer], 99)  # a mapped run's graph replays count on the device, not here
        now = store.counters.snapshot()
        pairs = ids.flatten().tolist() + ids[0].tolist() + [0] * 80 + ids[0].tolist()
        device = sum(e in on_device for e in pairs)
        assert now["layer_steps"] - before["layer_steps"] == 4
        assert now["expert_uses"] - before["expert_uses"] == len(pairs)
        assert now["gpu_hits"] - before["gpu_hits"] == device
        assert now["ram_hits"] - before["ram_hits"] == len(pairs) - device
        assert now["h2d_bytes"] - before["h2d_bytes"] == (len(pairs) - device) * manifest.record.nbytes
        assert store.counters.layers()[layer][0] == len(pairs)
        assert store.counters.snapshot() == now  # read twice: nothing counted twice
    finally:
        store.close()


@pytest.mark.gpu
def test_on_cuda_a_mapped_store_replays_graphs_with_the_tokens_of_resident_and_streamed_runs(converted):
    """Half the records on the device, the rest read from pinned RAM in place: decode by graph replay
    gives the tokens of everything resident and of streaming (--no-zero-copy), and counts both tiers."""
    cuda = torch.device("cuda")
    n = _plan(converted, cuda, 1, 1).total_records
    runs = {}
    for name, gpu, knobs in (("resident", n, {}), ("mapped", n // 2, {}), ("streamed", n // 2, {"zero_copy": False})):
        options = RunOptions(device="cuda", max_context=64, dtype="fp32", **knobs)
        with Engine(converted, options, plan=_plan(converted, cuda, gpu, n)) as engine:
            runs[name] = engine.generate(" ".join([PROMPT] * 2), max_tokens=12, temperature=0)  # > 16 tokens: prefill
            assert engine.model.experts.mapped == (name == "mapped")
    assert runs["mapped"].token_ids == runs["resident"].token_ids == runs["streamed"].token_ids
    assert runs["mapped"].stats.decode_mode.startswith("CUDA graph, zero-copy:")
    assert runs["streamed"].stats.decode_mode.startswith("CUDA graph in ")  # pieces between the loads
    g, m = runs["mapped"], Manifest.read(converted)
    s, layers = g.stats.store, len(_plan(converted, cuda, 1, 1).expert_layers)
    passes = g.stats.prompt_tokens + g.stats.generated_tokens - 1  # the prompt, then each token fed back but the last
    assert s["expert_uses"] == passes * m.args.n_activated_experts * layers  # graph replays counted, exactly
    assert s["gpu_hits"] + s["ram_hits"] == s["expert_uses"] and s["ram_hits"] > 0 and s["ssd_reads"] == 0
    assert s["h2d_bytes"] == s["ram_hits"] * m.record.nbytes
