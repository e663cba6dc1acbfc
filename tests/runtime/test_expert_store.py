"""The expert store: tiers under tiny budgets give the same tokens as everything resident; slot reuse
is race-free under random prefetch; O_DIRECT and its fallback; checksums; warm start from hot.json."""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import shutil
from concurrent.futures import wait
from pathlib import Path

import numpy as np
import pytest
import torch

from dsfp4.errors import ChecksumError, ManifestError
from dsfp4.layout import direct_io
from dsfp4.layout.direct_io import RecordFile, aligned_buffer
from dsfp4.layout.hot_profile import HOT_NAME, HotProfile
from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.generate.sampling_params import SamplingParams
from dsfp4.runtime.models.load import plan_run
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.store.expert_store import ExpertStore
from dsfp4.runtime.store.placement import fill, warm_start

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)
PROMPT = "Explain the tiers of the expert store"


def _plan(model_dir: Path, gpu_slots: int | None, ram_slots: int | None, io_threads: int = 4):
    """The planner's plan, with slot counts set directly (None: everything resident)."""
    manifest = Manifest.read(model_dir)
    plan = plan_run(manifest, CPU, torch.float32, 64, RunOptions(device="cpu", io_threads=io_threads), False)
    n = plan.total_records
    return dataclasses.replace(plan, gpu_slots=gpu_slots or n, ram_slots=ram_slots or n, staging=min(io_threads, n))


def _engine(model_dir: Path, gpu_slots=None, ram_slots=None, **knobs) -> Engine:
    options = RunOptions(device="cpu", max_context=64, **knobs)
    return Engine(model_dir, options, plan=_plan(model_dir, gpu_slots, ram_slots, options.io_threads))


def _generate(engine: Engine, n: int = 10):
    with engine:
        return engine.generate(PROMPT, max_tokens=n, temperature=0)


@pytest.fixture(scope="module")
def resident(converted):
    return _generate(_engine(converted))


@pytest.mark.parametrize(
    "gpu,ram,knobs",
    [
        (3, 5, {}),
        (3, 5, {"prefetch": False}),
        (3, 5, {"policy": "lfu"}),
        (3, 5, {"policy": "lru"}),
        (4, 1, {"io_threads": 1, "prefill_chunk": 3}),  # prompt in chunks; RAM is staging only
        (2, 1, {"io_threads": 1}),  # the least that runs: every expert is reloaded for every token
    ],
)
@pytest.mark.slow
def test_tiny_budgets_give_the_tokens_of_everything_resident(converted, resident, gpu, ram, knobs):
    g = _generate(_engine(converted, gpu, ram, **knobs))
    assert g.token_ids == resident.token_ids
    s = g.stats.store
    assert s["gpu_hits"] < s["expert_uses"] and s["ssd_reads"] > 0
    if gpu == 2:  # two experts per token and layer, two MoE layers, two slots: nothing survives a token
        assert s["gpu_hits"] == 0 and s["ssd_reads"] >= s["expert_uses"]


def test_everything_resident_reads_each_record_once(converted, resident):
    s = resident.stats.store
    assert s["ssd_reads"] <= 16 and s["gpu_hits"] + s["ram_hits"] + s["ssd_misses"] == s["expert_uses"]
    assert s["ssd_misses"] + s["prefetch_loads"] == s["ssd_reads"]  # prefetched records count as hits


def test_a_filled_store_serves_every_layer_from_the_device_without_loads(converted, resident, monkeypatch):
    """fill() puts every record on the device; the MoE layers then find experts through the device slot
    table (no load, no host sync) and give the same tokens."""
    engine = _engine(converted)
    store = engine.model.experts
    assert not store.all_resident
    fill(store)
    assert store.all_resident and store.counters.ssd_reads == store.plan.total_records
    monkeypatch.setattr(store, "load_waves", lambda *a: pytest.fail("a filled store loads nothing"))
    g = _generate(engine)
    assert g.token_ids == resident.token_ids
    assert g.stats.store["gpu_hits"] == g.stats.store["expert_uses"] > 0
    assert g.stats.decode_mode == "eager: CUDA graphs need a CUDA device"


@pytest.mark.parametrize("reads", [True, False])
def test_random_prefetch_never_corrupts_a_slot(converted, reads):
    """Random loads and random (wrong) predictions on 3 device and 5 RAM slots, 4 reader threads: every
    record handed out holds exactly its file bytes, and the device-side table matches the host's."""
    manifest = Manifest.read(converted)
    layout = manifest.record
    truth = {
        (layer, e): (converted / ef.file).read_bytes()[off : off + layout.nbytes]
        for layer, ef in manifest.experts.items()
        for e, off in enumerate(ef.offsets)
    }
    store = ExpertStore(converted, manifest, CPU, _plan(converted, 3, 5), io_threads=4, prefetch_reads=reads)
    rng = random.Random(0)
    layers, n = sorted(manifest.experts), manifest.args.n_routed_experts
    try:
        for _ in range(300):
            layer = rng.choice(layers)
            want = sorted(rng.sample(range(n), rng.randint(1, 5)))
            nxt = (rng.choice(layers), rng.sample(range(n), rng.randint(0, 6)))
            got = []
            for e, record in store.load(layer, want, nxt if rng.random() < 0.8 else None):
                got.append(e)
                assert bytes(record.numpy()) == truth[(layer, e)], (layer, e)
            assert sorted(got) == want
            table = store.slot_table().numpy()
            assert {(int(a), int(b)) for a, b in zip(*np.nonzero(table >= 0), strict=True)} == set(
                store.gpu_pool.slot_of
            )
            assert all(table[k] == s for k, s in store.gpu_pool.slot_of.items())
        store.sync()
        assert sum(store.gpu_pool.pins) == sum(store.ram_pool.pins) == 0
    finally:
        store.close()


def test_a_prefetch_reads_the_ssd_only_when_allowed(converted):
    """Guesses not in RAM are read from the SSD only with prefetch_reads; those in RAM are copied up either way."""
    manifest = Manifest.read(converted)
    layer = min(manifest.experts)
    for reads in (False, True):
        store = ExpertStore(converted, manifest, CPU, _plan(converted, 3, 5), prefetch_reads=reads)
        try:
            store.read_ahead([(layer, 0)], set())
            store.sync()
            before = store.counters.ssd_reads
            store.prefetch(layer, [0, 1], protect=set())
            store.sync()
            assert (layer, 0) in store.gpu_pool  # in RAM: copied up
            assert ((layer, 1) in store.gpu_pool) == reads
            assert store.counters.ssd_reads - before == int(reads)
        finally:
            store.close()


def test_record_reads_use_o_direct_and_fall_back_where_refused(converted, monkeypatch):
    manifest = Manifest.read(converted)
    ef = manifest.experts[min(manifest.experts)]
    want = (converted / ef.file).read_bytes()[ef.offsets[1] : ef.offsets[1] + manifest.record.nbytes]

    def read(direct_allowed: bool) -> RecordFile:
        f = RecordFile(converted / ef.file)
        buf = aligned_buffer(manifest.record.nbytes)
        f.read_into([buf], ef.offsets[1])
        f.close()
        assert bytes(buf) == want
        return f

    assert read(True).direct  # /tmp is a disk filesystem here
    assert not ExpertStore(converted, manifest, CPU, _plan(converted, 3, 5)).notes
    real_open = os.open

    def refuse_direct(path, flags, *args):  # what tmpfs (before Linux 6.6) and some FUSE mounts do
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", refuse_direct)
    assert not read(False).direct
    store = ExpertStore(converted, manifest, CPU, _plan(converted, 3, 5))
    assert len(store.notes) == 1 and "O_DIRECT" in store.notes[0] and "page cache" in store.notes[0]
    assert [e for e, _ in store.load(min(manifest.experts), [0, 1])] == [0, 1]
    store.close()


def _damaged(converted: Path, tmp_path: Path) -> tuple[Path, Manifest, int]:
    """A copy of the model whose last MoE layer's expert 5 has three bytes changed -> (it, its manifest, the layer)."""
    model = Path(shutil.copytree(converted, tmp_path / "model"))
    manifest = Manifest.read(model)
    layer = max(manifest.experts)
    ef = manifest.experts[layer]
    with open(model / ef.file, "r+b") as f:
        f.seek(ef.offsets[5] + 100)
        f.write(b"\xff\x00\xff")
    return model, manifest, layer


def test_a_damaged_record_names_layer_and_expert_unless_verify_is_off(converted, tmp_path):
    model, manifest, layer = _damaged(converted, tmp_path)
    for verify in (True, False):
        store = ExpertStore(model, manifest, CPU, _plan(model, 3, 5), verify=verify)
        try:
            if verify:
                with pytest.raises(ChecksumError, match=f"expert 5 \\(layer {layer}\\)"):
                    list(store.load(layer, [4, 5]))
                assert (layer, 5) not in store.gpu_pool and (layer, 5) not in store.ram_pool  # nothing kept
            else:
                assert [e for e, _ in store.load(layer, [4, 5])] == [4, 5]
        finally:
            store.close()


def test_a_damaged_record_read_before_its_copy_is_queued_leaves_no_slot_behind(converted, tmp_path, monkeypatch):
    """A read that has already failed when its copy is queued (a busy host: the reader ran first) fails the load
    where it is awaited, and no device slot keeps the expert whose record never arrived (it did, under load, before)."""
    model, manifest, layer = _damaged(converted, tmp_path)
    store = ExpertStore(model, manifest, CPU, _plan(model, 3, 5))
    try:
        reads = store.io.read

        def read_first(run):
            job = reads(run)
            if job is not None:
                wait([job])  # done, with its checksum error, before the copy is queued
            return job

        monkeypatch.setattr(store.io, "read", read_first)
        with pytest.raises(ChecksumError, match=f"expert 5 \\(layer {layer}\\)"):
            list(store.load(layer, [4, 5]))
        assert (layer, 5) not in store.gpu_pool and (layer, 5) not in store.ram_pool
        assert int(store.slot_table()[layer, 5]) == -1
    finally:
        store.close()


def test_warm_start_fills_the_device_and_ram_with_the_hottest(converted, tmp_path):
    model = Path(shutil.copytree(converted, tmp_path / "model"))
    manifest = Manifest.read(model)
    rng = np.random.default_rng(0)
    counts = {layer: tuple(int(c) for c in rng.permutation(8) * 10) for layer in manifest.experts}
    profile = HotProfile(manifest.conversion_sha256(), 100, counts)
    profile.write(model / HOT_NAME)
    with Engine(model, device="cpu", max_context=64) as engine:  # everything fits: all resident
        assert engine.model.experts.warm_records == 16 and not engine.notes
    plan = _plan(model, 3, 5)
    ranked = [k for k in profile.ranked() if k[0] in plan.expert_layers]  # not the MTP layer's experts
    store = ExpertStore(model, manifest, CPU, plan)
    warm_start(store, profile)
    res = store.residency()
    assert {k for k in ranked[:3]} == {(int(a), int(b)) for a, b in zip(*np.nonzero(res == 2), strict=True)}
    # inclusive tiers: RAM holds the 5 hottest, the device's 3 among them (an evicted one is still a RAM hit)
    assert set(ranked[:5]) == set(store.ram_pool.slot_of) and store.warm_records == 5
    store.close()
    store = ExpertStore(model, manifest, CPU, _plan(model, 12, 2))  # more device slots than RAM ones
    warm_start(store, profile)
    assert {k for k in ranked[:12]} == {
        (int(a), int(b)) for a, b in zip(*np.nonzero(store.residency() == 2), strict=True)
    }
    store.close()
    (model / HOT_NAME).write_text((model / HOT_NAME).read_text().replace(profile.conversion, "0" * 64))
    with pytest.raises(ManifestError, match="hot.json was measured on another model or conversion"):
        Engine(model, device="cpu", max_context=64)


def test_the_hot_policy_holds_the_warm_starts_hottest_records_in_ram(converted, tmp_path):
    model = Path(shutil.copytree(converted, tmp_path / "model"))
    manifest = Manifest.read(model)
    counts = {layer: tuple(range(8, 0, -1)) for layer in manifest.experts}  # expert 0 hottest
    profile = HotProfile(manifest.conversion_sha256(), 100, counts)
    store = ExpertStore(model, manifest, CPU, _plan(model, 2, 12), policy="hot")
    warm_start(store, profile)
    held = set(store.ram_pool.policies[0].held)
    assert held and len(held) <= 12 - (2 + store.plan.staging)  # room left to turn over
    ranked = [k for k in profile.ranked() if k[0] in store.plan.expert_layers]
    assert held <= set(ranked[: 2 + 12])
    for layer in sorted(store.plan.expert_layers):  # every other expert through the store: the held ones stay
        for _ in store.load(layer, [e for e in range(8) if (layer, e) not in held]):
            pass
    assert held <= set(store.ram_pool.slot_of)
    store.close()


@pytest.mark.gpu
def test_on_cuda_replayed_steps_run_ahead_of_the_host_and_keep_the_cache_of_the_tokens_given(converted):
    """Replayed steps are launched before the host reads their token (DecodeGraphs.tokens): a generation
    ended by a stop string or the budget leaves the cache of the tokens it gave, so the next turn equals a
    fresh engine's; seeded sampling on the device repeats."""
    options = RunOptions(device="cuda", max_context=640, dtype="fp32")
    with Engine(converted, options) as engine, Engine(converted, options) as fresh:
        prompt = engine.tokenizer.encode("hello world")
        full = engine.generate(prompt, max_tokens=12, temperature=0)
        assert full.stats.decode_mode == "CUDA graph" and len(full.token_ids) == 12
        stop = full.text[4:6]
        g = engine.generate(prompt, max_tokens=12, stop=stop, temperature=0)
        assert g.finish_reason == "stop" and g.text == full.text[: full.text.find(stop)]
        assert engine.cached == (prompt + full.token_ids)[: len(engine.cached)]
        follow = prompt + full.token_ids[:5]
        assert (
            engine.generate(follow, max_tokens=8, temperature=0).token_ids
            == fresh.generate(follow, max_tokens=8, temperature=0).token_ids
        )
        a, b, c = (engine.generate(prompt, max_tokens=10, temperature=1.0, seed=s).token_ids for s in (7, 7, 8))
        assert a == b and a != c


@pytest.mark.gpu
def test_on_cuda_tiny_budgets_give_the_tokens_of_everything_resident_and_stay_in_budget(converted):
    """Pinned RAM, the copy stream and its events: the same tokens as all-resident, and the device's peak
    (torch's max reserved) inside --gpu-mem set to the planner's minimum plus two slots."""
    cuda = torch.device("cuda")
    manifest = Manifest.read(converted)

    def run(gpu_slots, ram_slots, **knobs):
        options = RunOptions(device="cuda", max_context=64, dtype="fp32", **knobs)
        plan = plan_run(manifest, cuda, torch.float32, 64, options, False)
        if gpu_slots:
            plan = dataclasses.replace(plan, gpu_slots=gpu_slots, ram_slots=ram_slots, staging=min(4, ram_slots))
        return _generate(Engine(converted, options, plan=plan), 8)

    resident = run(None, None).token_ids
    for knobs in ({}, {"prefetch": False}, {"policy": "lru"}):
        assert run(3, 5, **knobs).token_ids == resident
        assert run(2, 1, io_threads=1, **knobs).token_ids == resident
    floor = plan_run(manifest, cuda, torch.float32, 64, RunOptions(device="cuda", gpu_mem="1T"), False)
    budget = floor.backbone + floor.kv_cache + floor.workspace + 4 * floor.record
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(cuda)
    base = torch.cuda.memory_reserved(cuda)  # what earlier tests left (e.g. cuBLAS workspaces of their streams)
    g = run(None, None, gpu_mem=str(budget), cpu_mem="64G")
    assert g.token_ids == resident and g.stats.peak_gpu - base <= budget


@pytest.mark.gpu
def test_on_cuda_streamed_experts_decode_by_graph_pieces_with_the_tokens_of_eager_steps(converted):
    """Fewer device and RAM slots than records, nothing mapped: a decode step replays in pieces, each MoE
    layer's loads run between them; the tokens equal eager steps' across two attention spans, and the loads
    count the same uses (plus, at most, the step launched ahead for a token the caller stopped at)."""
    cuda = torch.device("cuda")
    manifest = Manifest.read(converted)
    runs = {}
    for graph in (True, False):
        options = RunOptions(device="cuda", max_context=640, dtype="fp32", cuda_graph=graph, zero_copy=False)
        plan = plan_run(manifest, cuda, torch.float32, 640, options, False)
        plan = dataclasses.replace(plan, gpu_slots=3, ram_slots=5, staging=4)
        with Engine(converted, options, plan=plan) as engine:
            runs[graph] = engine.generate(PROMPT, max_tokens=300, temperature=0)
    g, e, layers = runs[True], runs[False], len(plan.expert_layers)
    assert g.stats.decode_mode == f"CUDA graph in {layers + 1} pieces, streamed experts loaded between them"
    assert e.stats.decode_mode == "eager: --no-cuda-graph"
    assert g.token_ids == e.token_ids and g.stats.prompt_tokens + len(g.token_ids) > 256
    assert g.stats.store["ssd_reads"] > 0
    extra = g.stats.store["expert_uses"] - e.stats.store["expert_uses"]
    assert extra in (0, layers * manifest.args.n_activated_experts)


@pytest.mark.gpu
def test_on_cuda_everything_resident_decodes_by_graph_replay_with_the_tokens_of_eager_steps(converted):
    """Every expert fits: the engine fills the device and replays captured decode steps; the tokens equal
    eager steps' (the same kernels), across several attention spans of the cache."""
    runs = {}
    for graph in (True, False):
        options = RunOptions(device="cuda", max_context=640, dtype="fp32", cuda_graph=graph)
        with Engine(converted, options) as engine:
            g = engine.generate(PROMPT, max_tokens=300, temperature=0)  # positions past 256: two spans
            runs[graph] = g
            assert engine.model.experts.all_resident
    assert runs[True].stats.decode_mode == "CUDA graph" and runs[False].stats.decode_mode == "eager: --no-cuda-graph"
    assert runs[True].token_ids == runs[False].token_ids


def test_a_layer_of_more_experts_than_slots_comes_in_waves_of_half_the_slots(converted):
    """Where one wave cannot hold a layer's experts, a wave takes half the slots (store/waves.py): its copies land in
    slots the wave before it does not hold. Every expert comes once, its record the one on disk."""
    from dsfp4.runtime.plan.planner import expert_layers
    from dsfp4.runtime.store.waves import wave_size

    assert [wave_size(e, 6) for e in (1, 6, 7, 40)] == [6, 6, 3, 3] and wave_size(9, 1) == 1
    engine = _engine(converted, gpu_slots=4)
    with engine:
        store = engine.model.experts
        layer = expert_layers(store.manifest)[0]
        experts = list(range(store.n_experts))
        assert len(experts) > 4
        seen = []
        for wave in store.load_waves(layer, experts):
            assert len(wave) <= 2
            seen += wave
            for e in wave:
                gpu, ram = store.gpu_pool.slot_of[(layer, e)], store.ram_pool.slot_of[(layer, e)]
                assert torch.equal(store.gpu[gpu], store.ram[ram])
        assert sorted(seen) == experts
