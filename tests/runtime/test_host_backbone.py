"""Backbone in pinned host memory, read in place by the device (runtime/plan/host_backbone.py,
runtime/models/host_memory.py): what the planner moves and why, and that a run with part of its backbone there
gives the tokens of one with all of it on the device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsfp4.errors import ConfigError
from dsfp4.layout.manifest import Manifest
from dsfp4.projection.planned import planned_manifest
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.models.load import plan_run
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.plan.budget import PRESETS, Budgets, GiB
from dsfp4.runtime.plan.host_backbone import HostBackbone, layer_bytes, place_on_host, spans, tensor_bytes
from dsfp4.runtime.plan.planner import backbone_bytes, layer_cache_bytes, make_plan
from dsfp4.runtime.plan.workspace import dequant_bytes
from dsfp4.synthetic.bench_model import model_args

CUDA = torch.device("cuda")  # planned as on a GPU machine: nothing here touches one
PROMPT = "Explain the tiers of the expert store"


def _v3(backbone: str = "fp8_e4m3_b128") -> Manifest:
    return planned_manifest(model_args(61, 3)[1], backbone)


def _plan(m: Manifest, preset: str):
    p = PRESETS[preset]
    return make_plan(
        m, CUDA, torch.bfloat16, Budgets(p.gpu, p.cpu, preset), 4096, 512, 4, process=GiB // 2, fp8_kernels=True
    )


def test_v3_with_its_fp8_backbone_plans_on_16g_with_the_embedding_and_the_largest_layers_in_ram():
    m = _v3()
    whole = backbone_bytes(m, torch.bfloat16)
    plan = _plan(m, "16g")
    on = plan.on_host
    assert on.embed and set(on.layers) >= {0, 1, 2}  # the dense layers are the largest
    assert plan.backbone + plan.host_backbone == whole and plan.backbone + plan.kv_cache + plan.workspace < 15 * GiB
    assert plan.gpu_slots >= 2 * m.args.n_activated_experts
    sizes = layer_bytes(m, 2, range(m.args.n_layers))
    moved = tensor_bytes("embed.weight", m.tensors["embed.weight"], 2) + sum(sizes[i] for i in on.layers)
    assert moved == plan.host_backbone
    # the least that fits: the last layer it took, left on the device, would not
    last = min(on.layers, key=lambda i: (sizes[i], i))
    kept = whole - moved + sizes[last]
    assert kept + plan.kv_cache + plan.workspace + 2 * m.args.n_activated_experts * plan.record > plan.budgets.gpu
    # what RAM gives the backbone, the record cache loses
    resident = _plan(m, "24g")
    assert resident.host_backbone == 0 and not resident.on_host.embed
    # the latent caches went first, all of them: still short, then backbone
    assert len(plan.on_host.caches) == m.args.n_layers and plan.kv_cache < plan.host_kv
    assert plan.ram_slots == (plan.budgets.cpu - plan.host_base - plan.host_backbone - plan.host_kv) // plan.record
    assert "embedding, layers 0-2" in plan.table() and "read in place over PCIe" in plan.table()


def test_a_backbone_that_fits_stays_on_the_device_and_the_cpu_never_moves_any():
    assert _plan(_v3("nvfp4"), "16g").host_backbone == 0
    m = _v3()
    cpu = make_plan(m, torch.device("cpu"), torch.bfloat16, Budgets(30 * GiB, 200 * GiB, "x"), 4096, 512, 4, process=0)
    assert cpu.host_backbone == 0 and cpu.on_host == HostBackbone()


def test_placement_takes_the_embedding_first_and_never_a_tied_one(converted):
    m = Manifest.read(converted)
    on, moved = place_on_host(m, 4, range(m.args.n_layers), 1)
    assert on.embed and on.layers == () and moved == tensor_bytes("embed.weight", m.tensors["embed.weight"], 4)
    tied = dataclasses.replace(m, args=dataclasses.replace(m.args, tie_word_embeddings=True))
    on, _ = place_on_host(tied, 4, range(m.args.n_layers), 1)
    assert not on.embed and len(on.layers) == 1
    assert place_on_host(m, 4, range(m.args.n_layers), 0) == (HostBackbone(), 0)
    on, moved = place_on_host(m, 4, range(m.args.n_layers), 1 << 40)  # everything it may, still short
    assert on.layers == tuple(range(m.args.n_layers))
    assert moved == sum(tensor_bytes(n, t, 4) for n, t in m.tensors.items() if on.holds(n))
    assert not on.holds("head.weight") and not on.holds("norm.weight")  # every token reads all of them


def test_a_plan_too_small_even_with_the_backbone_in_ram_names_what_moved():
    with pytest.raises(ConfigError, match=r"--gpu-mem .* in RAM"):
        make_plan(
            _v3(), CUDA, torch.bfloat16, Budgets(2 * GiB, 200 * GiB, "x"), 4096, 512, 4, process=0, fp8_kernels=True
        )


def test_dequantization_reserve_counts_only_what_the_kernels_copy():
    m = _v3("nvfp4")
    largest = max(n for t in m.tensors.values() if t.format == "nvfp4" for n in [t.shape[0] * t.shape[1]])
    wkv_b = m.tensors["layers.5.attn.wkv_b"].shape
    assert dequant_bytes(m, torch.bfloat16, kernels=False, fp8_kernels=True) == largest * (8 + 2)
    assert dequant_bytes(m, torch.bfloat16, kernels=True, fp8_kernels=True) == wkv_b[0] * wkv_b[1] * (8 + 2)
    assert dequant_bytes(m, torch.float32, kernels=True, fp8_kernels=True) == largest * (8 + 4)  # fp32: reference
    f = _v3()
    wkv_b = f.tensors["layers.5.attn.wkv_b"].shape
    assert dequant_bytes(f, torch.bfloat16, kernels=True, fp8_kernels=True) == wkv_b[0] * wkv_b[1] * 4  # one pass
    fp8_largest = max(t.shape[0] * t.shape[1] for t in f.tensors.values() if t.format == "fp8_e4m3_b128")
    assert dequant_bytes(f, torch.bfloat16, kernels=True, fp8_kernels=False) == fp8_largest * (8 + 2)


def test_spans():
    assert spans((0, 1, 2, 7, 9, 10)) == "0-2, 7, 9-10" and spans((4,)) == "4" and spans(()) == ""


def _host_plan(converted, device: torch.device, on: HostBackbone):
    m = Manifest.read(converted)
    plan = plan_run(m, device, torch.float32, 64, RunOptions(device=device.type), False)
    moved = sum(tensor_bytes(n, t, 4) for n, t in m.tensors.items() if on.holds(n))
    kv = sum(sum(layer_cache_bytes(m.args, i, 64, 4)) for i in on.caches)
    return dataclasses.replace(plan, host_backbone=moved, on_host=on, host_kv=kv, kv_cache=plan.kv_cache - kv)


def _resident_and_on_host(converted, device: torch.device, on: HostBackbone | None = None):
    """(a resident run's generation, one with `on` in host memory (default: the embedding and two layers), its
    engine: open)."""
    options = RunOptions(device=device.type, max_context=64, dtype="fp32")
    m = Manifest.read(converted)
    on = on or HostBackbone(embed=True, layers=(0, m.args.n_layers - 1))
    runs = []
    for plan in (None, _host_plan(converted, device, on)):
        engine = Engine(converted, options, plan=plan)
        runs.append(engine.generate(" ".join([PROMPT] * 2), max_tokens=10, temperature=0))  # > 16 tokens: prefill
        if plan is not None:
            return runs[0], runs[1], engine
        engine.close()
    raise AssertionError


def test_deepseek_v4_loads_with_its_fp32_and_int64_tensors_in_host_memory(v4_converted):
    """V4 keeps more of its small tensors in fp32 than the plan counts, and its hash layers' int64 table: the arena
    grows to hold them, and the tokens are a resident run's."""
    resident, on_host, engine = _resident_and_on_host(v4_converted, torch.device("cpu"))
    engine.close()
    assert on_host.token_ids == resident.token_ids


def test_tokens_with_layers_and_the_embedding_in_host_memory_equal_a_resident_run(converted):
    resident, on_host, engine = _resident_and_on_host(converted, torch.device("cpu"))
    try:
        assert on_host.token_ids == resident.token_ids
        arena = engine.model.embed.untyped_storage().data_ptr()  # every host tensor is a view of one arena
        assert engine.model.layers[0].attn.wo.parts[0].untyped_storage().data_ptr() == arena
        assert engine.model.layers[-1].attn_norm.weight.untyped_storage().data_ptr() == arena
        assert engine.model.layers[1].attn.wo.parts[0].untyped_storage().data_ptr() != arena
    finally:
        engine.close()


def _kv_in_ram(converted) -> HostBackbone:
    return HostBackbone(caches=(0, Manifest.read(converted).args.n_layers - 1))


def test_tokens_with_kv_caches_in_host_memory_equal_a_resident_run(converted):
    resident, on_host, engine = _resident_and_on_host(converted, torch.device("cpu"), _kv_in_ram(converted))
    try:
        assert on_host.token_ids == resident.token_ids
        layers = engine.model.layers
        # the two layers' caches are views of one arena; the others are not in it
        arena = layers[0].attn.kv_cache.untyped_storage().data_ptr()
        assert layers[-1].attn.pe_cache.untyped_storage().data_ptr() == arena
        assert layers[1].attn.kv_cache.untyped_storage().data_ptr() != arena
        a, n = engine.model.args, on_host.stats.prompt_tokens + on_host.stats.generated_tokens
        assert on_host.stats.host_cache_step == 2 * n * (a.kv_lora_rank + a.qk_rope_head_dim) * 4
        assert "KV cache in RAM read in place" in on_host.stats.table() and resident.stats.host_cache_step == 0
    finally:
        engine.close()


@pytest.mark.gpu
def test_on_cuda_attention_and_graphs_read_kv_caches_in_ram_in_place_with_the_tokens_of_a_resident_run(converted):
    resident, on_host, engine = _resident_and_on_host(converted, CUDA, _kv_in_ram(converted))
    try:
        assert on_host.token_ids == resident.token_ids and on_host.stats.decode_mode.startswith("CUDA graph")
        layers = engine.model.layers
        assert not _in_device_memory(layers[0].attn.kv_cache) and _in_device_memory(layers[1].attn.kv_cache)
    finally:
        engine.close()


def test_at_the_models_whole_context_v3s_latent_cache_goes_to_ram_before_any_backbone():
    """163,840 positions on the 16 GB machine: 10.5 GiB of latent rows, read in place, rather than the backbone
    they would push off the card (a step reads a layer's weights whole; a cache's rows only up to its position)."""
    from dsfp4.projection.machines import MACHINES
    from dsfp4.projection.whole_model import full_plan

    _, short = full_plan("v3", MACHINES["16g"])
    _, long = full_plan("v3", MACHINES["16g"], max_context=163840)
    assert short.host_kv == 0 and not short.on_host.caches
    assert long.host_backbone == 0 and not long.on_host.layers and long.host_kv > 10 * GiB
    assert "caches: read in place over PCIe" in long.table()
    assert long.ram_slots < short.ram_slots  # what RAM gives the caches, the record cache loses
    _, v4 = full_plan("v4", MACHINES["16g"], max_context=163840)
    assert not v4.on_host.caches  # V4's model keeps its caches on the device (its family's rule)


def test_a_context_whose_caches_in_ram_do_not_fit_is_refused_with_the_longest_that_would():
    from dsfp4.projection.machines import MACHINES
    from dsfp4.projection.whole_model import full_plan

    m, plan = full_plan("v3", MACHINES["16g"], max_context=163840)
    short = Budgets(plan.budgets.gpu, 8 * GiB, "x")
    with pytest.raises(ConfigError, match=r"--cpu-mem 8.00 GiB is too small.*or --max-context (\d+) at most") as e:
        make_plan(m, CUDA, torch.bfloat16, short, 163840, 512, 4, process=GiB // 2, fp8_kernels=True)
    fit = int(e.value.args[0].rsplit("--max-context ", 1)[1].split()[0])
    make_plan(m, CUDA, torch.bfloat16, short, fit, 512, 4, process=GiB // 2, fp8_kernels=True)  # that one plans


def _in_device_memory(t: torch.Tensor) -> bool:
    """Whether t's memory is one of torch's device allocations (not pinned host pages at a device address)."""
    segments = torch.cuda.memory_snapshot()
    return any(s["address"] <= t.data_ptr() < s["address"] + s["total_size"] for s in segments)


@pytest.mark.gpu
def test_on_cuda_kernels_and_graphs_read_host_backbone_in_place_with_the_tokens_of_a_resident_run(converted):
    resident, on_host, engine = _resident_and_on_host(converted, CUDA)
    try:
        assert on_host.token_ids == resident.token_ids
        assert (
            on_host.stats.decode_mode.startswith("CUDA graph")
            and resident.stats.decode_mode == on_host.stats.decode_mode
        )
        model = engine.model
        assert model.embed.is_cuda and not _in_device_memory(model.embed)
        assert not _in_device_memory(model.layers[0].attn.wo.parts[0]) and _in_device_memory(
            model.layers[1].attn.wo.parts[0]
        )
    finally:
        engine.close()


def _sparse(path, n: int) -> None:
    with open(path, "wb") as f:
        f.truncate(n)


def test_run_plan_on_a_v3_shaped_fp8_model_at_16g_plans_and_says_what_is_in_ram(tmp_path, monkeypatch):
    """The acceptance of issue 33 item 3 from the CLI: the manifest of the whole V3 with its FP8 backbone over sparse
    files of its sizes (--plan reads the manifest only), planned as on a CUDA machine."""
    from click.testing import CliRunner

    import dsfp4.runtime.models.load as load
    from dsfp4.cli.main import cli

    m = _v3()
    m.write(tmp_path)
    sizes = {rel: f.nbytes for rel, f in m.files.items()}
    sizes.update({e.file: max(e.offsets) + m.record.nbytes for e in m.experts.values()})
    for rel, n in sizes.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        _sparse(tmp_path / rel, n)
    monkeypatch.setattr(load, "resolve_device", lambda _: CUDA)
    r = CliRunner().invoke(cli, ["run", str(tmp_path), "--plan", "--preset", "16g"])
    assert r.exit_code == 0, r.output
    assert "backbone" in r.output and "embedding, layers 0-2" in r.output and "read in place over PCIe" in r.output


def test_the_arena_grows_past_its_plan_and_aligns_every_tensor():
    from dsfp4.runtime.models.host_memory import ALIGN, HostArena

    arena = HostArena(64, torch.device("cpu"))
    small = arena.put(torch.arange(3, dtype=torch.float32))
    big = arena.put(torch.ones(1000, dtype=torch.float64))  # past the 64 planned bytes: a second chunk
    assert len(arena.chunks) == 2 and torch.equal(small, torch.arange(3, dtype=torch.float32))
    assert torch.equal(big, torch.ones(1000, dtype=torch.float64))
    third = arena.put(torch.tensor([7], dtype=torch.int64))
    assert third.data_ptr() % ALIGN == 0 and third.item() == 7


def test_the_prompt_cache_saves_and_restores_kv_caches_in_host_memory(converted, tmp_path):
    options = RunOptions(device="cpu", max_context=64, dtype="fp32", prompt_cache=tmp_path / "pc")
    prompt = " ".join([PROMPT] * 2)
    plan = _host_plan(converted, torch.device("cpu"), _kv_in_ram(converted))
    with Engine(converted, options, plan=plan) as engine:
        first = engine.generate(prompt, max_tokens=6, temperature=0)
    with Engine(converted, options, plan=plan) as engine:
        again = engine.generate(prompt, max_tokens=6, temperature=0)
    assert again.stats.restored_tokens > 0 and again.token_ids == first.token_ids
