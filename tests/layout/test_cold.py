"""Cold records: 2- and 3-bit codes that widen exactly to FP4 records, narrowed by a repack outside each layer's hot
set, read by the store at their own size and widened on their way to a slot (the kernel against its reference)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dsfp4.cli.main import cli
from dsfp4.errors import ConfigError, FormatError
from dsfp4.kernels.fp4.widen import widen_codes, widen_record
from dsfp4.layout.cold import (
    COLD_BITS,
    COLD_MAGNITUDES,
    cold_luts,
    cold_to_e2m1,
    cold_values,
    narrow,
    pack_cold,
    unpack_cold,
    widen,
)
from dsfp4.layout.fp4 import e2m1_decode, mxfp4_dequantize, nvfp4_dequantize, nvfp4_quantize, unpack_fp4
from dsfp4.layout.hot_profile import HOT_NAME, HotProfile
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.record import RecordLayout
from dsfp4.layout.repack import Cold, repack
from dsfp4.layout.verify import verify
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.models.load import plan_run
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.plan.budget import Budgets
from dsfp4.runtime.plan.planner import make_plan
from dsfp4.runtime.store.expert_store import ExpertStore
from dsfp4.runtime.store.placement import hottest_first, map_all
from tests.fixtures.moe_records import quantized_record

CPU = torch.device("cpu")
GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("bits", COLD_BITS)
def test_every_code_in_every_position_round_trips_and_widens_to_its_level(bits):
    per = 8 if bits == 3 else 4  # codes per packing group
    codes = torch.arange(per * 2**bits, dtype=torch.uint8).reshape(1, -1) % 2**bits  # each code in each slot
    codes = torch.cat([codes, codes.roll(1, dims=1)])
    assert torch.equal(unpack_cold(pack_cold(codes, bits), bits), codes)
    wide = unpack_fp4(widen(pack_cold(codes, bits), bits))
    assert torch.equal(e2m1_decode(wide), cold_values(codes, bits))
    levels = sorted({abs(v) for v in cold_values(torch.arange(2**bits, dtype=torch.uint8), bits).tolist()})
    assert tuple(levels) == COLD_MAGNITUDES[bits]


def test_bad_widths_and_lengths_are_refused():
    with pytest.raises(FormatError, match="2 or 3 bits"):
        cold_to_e2m1(4)
    with pytest.raises(FormatError, match="multiple of 8"):
        pack_cold(torch.zeros(1, 12, dtype=torch.uint8), 3)
    with pytest.raises(FormatError, match="nvfp4"):
        narrow("nvfp4", torch.ones(1, 16), 2)  # NVFP4 needs its global scale


@pytest.mark.parametrize("bits", COLD_BITS)
def test_values_on_the_grid_narrow_exactly(bits):
    """A block of levels times a representable scale comes back unchanged (NVFP4 and MXFP4)."""
    codes = torch.randint(0, 2**bits, (8, 64), generator=GEN, dtype=torch.uint8)
    codes[:, ::16] = 2**bits // 2 - 1  # each block holds the top level: its amax picks the scale
    scale = 2.0 ** torch.randint(-3, 3, (8, 2), generator=GEN).float()  # per 32: both formats' blocks
    w = cold_values(codes, bits) * scale.repeat_interleave(32, dim=1)
    g = torch.tensor(0.5)
    packed, s = narrow("nvfp4", w, bits, g)
    assert torch.equal(nvfp4_dequantize(widen(packed, bits), s, g), w)
    packed, s = narrow("mxfp4", w, bits)
    assert torch.equal(mxfp4_dequantize(widen(packed, bits), s), w)


def test_three_bits_lose_less_than_two_and_the_scale_search_helps():
    w = torch.randn(64, 256, generator=GEN)
    packed, s, g = nvfp4_quantize(w)
    exact = nvfp4_dequantize(packed, s, g)
    errs = {}
    for bits in COLD_BITS:
        p, sc = narrow("nvfp4", exact, bits, g)
        errs[bits] = float(((nvfp4_dequantize(widen(p, bits), sc, g) - exact) ** 2).mean() / (exact**2).mean())
    assert errs[3] < errs[2] < 0.13 and errs[3] < 0.045  # Lloyd-Max for a Gaussian: 0.117 and 0.035


def _record(fmt: str, dim: int = 256, inter: int = 96) -> tuple[RecordLayout, torch.Tensor]:
    return quantized_record(fmt, GEN, dim, inter)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("bits", COLD_BITS)
def test_a_narrowed_record_widens_to_its_format_and_the_kernel_matches_the_reference(fmt, bits):
    layout, record = _record(fmt)
    cold = layout.cold_of(bits)
    narrowed = layout.narrow(record, bits)
    assert narrowed.numel() == cold.nbytes < layout.nbytes and cold.wide() == layout
    assert RecordLayout.from_dict(cold.to_dict()) == cold and "code_bits" not in layout.to_dict()
    wide = cold.widen(narrowed)
    for a, b in zip(layout.dequantize(wide), cold.dequantize(narrowed), strict=True):
        assert torch.equal(a, b)  # stored() widens: every reader sees the same values
    if fmt == "nvfp4":  # the global scales stay
        assert torch.equal(layout.unpack(wide)["scale_2"], layout.unpack(record)["scale_2"])
    got = torch.full((layout.nbytes + 64,), 7, dtype=torch.uint8)
    for p in layout.parts:  # the kernel: each part through it, the padding left alone
        cp = cold.part(p.name)
        if p.name in ("w13", "w2"):
            widen_codes(
                narrowed[cp.offset : cp.offset + cp.nbytes],
                got[p.offset : p.offset + p.nbytes],
                cold_to_e2m1(bits),
                bits,
            )
        else:
            got[p.offset : p.offset + p.nbytes] = narrowed[cp.offset : cp.offset + cp.nbytes]
    for p in layout.parts:
        assert torch.equal(got[p.offset : p.offset + p.nbytes], wide[p.offset : p.offset + p.nbytes]), p.name
    ref = torch.zeros(layout.nbytes, dtype=torch.uint8)
    widen_record(narrowed, ref, cold, cold_luts())  # on the CPU: the reference, by the one rule
    assert torch.equal(ref, wide)
    with pytest.raises(FormatError, match="narrowed again"):
        cold.narrow(narrowed, bits)


def _engine(model_dir: Path, slots: tuple[int, int] | None) -> Engine:
    """slots (device, RAM); None: every record resident."""
    m = Manifest.read(model_dir)
    plan = plan_run(m, CPU, torch.float32, 64, RunOptions(device="cpu"), False)
    if slots:
        plan = dataclasses.replace(plan, gpu_slots=slots[0], ram_slots=slots[1], staging=1)
    return Engine(model_dir, RunOptions(device="cpu", max_context=64, io_threads=1), plan=plan)


def _generate(model_dir: Path, slots: tuple[int, int] | None):
    with _engine(model_dir, slots) as engine:
        return engine.generate("Which experts are cold?", max_tokens=8, temperature=0)


@pytest.mark.slow
def test_repack_narrows_the_cold_experts_and_the_store_reads_them_at_their_size(model):
    before = Manifest.read(model)
    profile = HotProfile.read(model / HOT_NAME)
    r = repack(model, profile, cold=Cold(3, 0.5))
    assert (r.rewritten, r.narrowed) == (2, 8)  # 4 of 8 experts in each of the two profiled layers
    m = Manifest.read(model)
    for layer in (1, 2):
        ef, order = m.experts[layer], profile.order(layer)
        assert ef.cold == tuple(sorted(order[4:])) and ef.exact() == dataclasses.replace(
            before.experts[layer], file=ef.file, offsets=ef.offsets
        )
        n, c = m.record.nbytes, ef.cold_record.nbytes
        assert [ef.offsets[e] for e in order] == [i * n for i in range(4)] + [4 * n + i * c for i in range(4)]
    assert m.experts[3].cold == ()  # the MTP layer is not profiled: left as it was
    assert m.experts[1].cold_record.code_bits == (3, 3, 3) and m.exact_sha256() == before.conversion_sha256()
    assert m.version == 1  # one width everywhere: what earlier readers read
    assert m.conversion_sha256() != before.conversion_sha256()  # prompt caches and exports bind to the records
    verify(model)  # the records' own checksums; hot.json still binds (to exact_sha256)
    assert repack(model, profile, cold=Cold(3, 0.5)).rewritten == 0
    with pytest.raises(ConfigError, match="cannot be undone"):
        repack(model, profile, cold=Cold(2, 0.5))
    assert repack(model, profile).rewritten == 0  # a plain repack keeps what is cold as it is

    resident, streamed = _generate(model, None), _generate(model, (2, 1))
    assert streamed.token_ids == resident.token_ids  # widened on the way, from RAM or the SSD alike
    s = streamed.stats.store
    assert s["ssd_reads"] > 0
    sizes = {m.record.nbytes, m.cold_nbytes()}
    assert s["ssd_bytes"] < s["ssd_reads"] * m.record.nbytes and s["ssd_bytes"] >= s["ssd_reads"] * min(sizes)


@pytest.mark.slow
def test_a_ram_budget_short_of_every_record_holds_cold_ones_in_narrow_slots(model):
    """The planner splits the RAM cache (narrow_slots): a slot for each record of the model's format, the rest of the
    room in slots of a cold record's size, so RAM holds more records than at full size; the tokens stay exact."""
    repack(model, HotProfile.read(model / HOT_NAME), cold=Cold(2, 0.5))
    m = Manifest.read(model)
    n, c = m.record.nbytes, m.cold_nbytes()
    room = 8 * n + 6 * c  # on a CPU device the RAM budget is all the record cache's
    options = RunOptions(device="cpu", max_context=64, io_threads=1, zero_copy=False)
    fixed = make_plan(m, CPU, torch.float32, Budgets(1 << 40, room, "test"), 64, 64, 1, process=0)
    fixed = fixed.backbone + fixed.kv_cache + fixed.workspace + fixed.host_base
    plan = make_plan(m, CPU, torch.float32, Budgets(fixed + 2 * n, room, "test"), 64, 64, 1, process=0)
    assert plan.gpu_slots == 2 and plan.cold_slots > 0
    assert plan.record_cache <= room < plan.ram_slots * n  # RAM holds more records than at full size
    assert (plan.ram_slots, plan.cold_slots) == (14, 6)  # a wide slot for each of the 8 hot records, then narrow ones
    assert f"{plan.cold_slots} of" in plan.table() and "for cold records" in plan.table()
    resident = _generate(model, None).token_ids
    for gpu in (2, 15):  # 15: the warm start takes the device's records through RAM, as much as each size holds
        with Engine(model, options, plan=dataclasses.replace(plan, gpu_slots=gpu)) as engine:
            streamed = engine.generate("Which experts are cold?", max_tokens=8, temperature=0)
            pool, wide = engine.model.experts.ram_pool, plan.ram_slots - plan.cold_slots
            assert all((slot >= wide) == m.layout_of(key).cold for key, slot in pool.slot_of.items())
            assert len(pool.slot_of) > wide  # the narrow slots were used
        assert streamed.token_ids == resident, gpu
    bad = dataclasses.replace(plan, cold_record=m.cold_nbytes() - 4096)
    with pytest.raises(ConfigError, match="narrow RAM slots"):
        ExpertStore(model, m, CPU, bad)  # a hand-made plan whose narrow slots cannot hold a cold record


def test_a_mapped_store_widens_its_cold_records_in_ram(model):
    repack(model, HotProfile.read(model / HOT_NAME), cold=Cold(2, 0.25))
    m = Manifest.read(model)
    plan = plan_run(m, CPU, torch.float32, 64, RunOptions(device="cpu"), False)
    plan = dataclasses.replace(plan, gpu_slots=2, ram_slots=plan.total_records)
    store = ExpertStore(model, m, CPU, plan)
    try:
        map_all(store, hottest_first(m, plan, None))
        in_ram = [
            (k, s)
            for k, s in store.ram_pool.slot_of.items()
            if k not in store.gpu_pool and k[1] in m.experts[k[0]].cold
        ]
        assert in_ram
        for (layer, e), rslot in in_ram:
            raw = (Path(model) / m.experts[layer].file).read_bytes()
            at, cold = m.experts[layer].offsets[e], m.layout_of((layer, e))
            want = cold.widen(torch.frombuffer(bytearray(raw[at : at + cold.nbytes]), dtype=torch.uint8))
            assert torch.equal(store.ram[rslot], want)
    finally:
        store.close()


def test_cold_bits_flags_are_checked(model):
    runner = CliRunner()
    r = runner.invoke(cli, ["profile-hot", str(model), "--no-measure", "--cold-bits", "3"])
    assert r.exit_code == 2 and "--repack" in r.output
    r = runner.invoke(cli, ["profile-hot", str(model), "--no-measure", "--repack", "--hot-share", "0.5"])
    assert r.exit_code == 2 and "--cold-bits" in r.output
    r = runner.invoke(cli, ["profile-hot", str(model), "--no-measure", "--repack", "--cold-bits", "2"])
    assert r.exit_code == 1 and "hold all" in r.output  # the default budgets hold this tiny model


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [*COLD_BITS, (2, 2, 3), (3, 2, 4), (2, 3, 2)])
def test_on_cuda_the_kernel_widens_a_v3_record_as_the_reference_does(bits):
    layout = RecordLayout.for_expert("nvfp4", 7168, 2048)
    cold = layout.cold_of(bits)
    src = torch.randint(0, 256, (cold.nbytes,), dtype=torch.uint8, generator=GEN)
    dst = torch.zeros(layout.nbytes + 4096, dtype=torch.uint8, device="cuda")
    widen_record(src.cuda(), dst, cold, cold_luts("cuda"))
    assert torch.equal(dst[: layout.nbytes].cpu(), cold.widen(src))


@pytest.mark.gpu
def test_on_cuda_cold_records_stream_with_the_tokens_of_everything_resident(model):
    """Widened on the copy stream from one staging buffer, by graph pieces and eagerly, mapped or streamed."""
    repack(model, HotProfile.read(model / HOT_NAME), cold=Cold(3, 0.25))
    cuda, m = torch.device("cuda"), Manifest.read(model)

    def run(slots: tuple[int, int] | None, cold_slots: int = 0, **knobs):
        options = RunOptions(device="cuda", max_context=64, dtype="fp32", **knobs)
        plan = plan_run(m, cuda, torch.float32, 64, options, False)
        if slots:
            g, r = slots
            staging = min(4, r - cold_slots, cold_slots or r)
            plan = dataclasses.replace(plan, gpu_slots=g, ram_slots=r, staging=staging, cold_slots=cold_slots)
            plan = dataclasses.replace(plan, cold_record=m.cold_nbytes() * bool(cold_slots))
        with Engine(model, options, plan=plan) as engine:
            return engine.generate("Which experts are cold?", max_tokens=12, temperature=0)

    resident = run(None)
    cases = [((3, 5), 0, {"zero_copy": False}), ((2, 1), 0, {"io_threads": 1}), ((3, 16), 0, {})]
    cases += [((3, 6), 3, {}), ((2, 12), 8, {"io_threads": 1})]  # cold records in RAM slots of their size
    for slots, cold_slots, knobs in cases:
        g = run(slots, cold_slots, **knobs)
        assert g.token_ids == resident.token_ids, (slots, cold_slots, knobs)
    assert run((3, 5), cuda_graph=False).token_ids == resident.token_ids


def test_exports_read_a_cold_record_widened(model):
    """gguf reads a matrix's spans (stored_from), compressed-tensors and modelopt whole records (_records): both see
    the record of the model's format that the kernels see."""
    from dsfp4.convert.export.writer import _records

    repack(model, HotProfile.read(model / HOT_NAME), cold=Cold(2, 0.5))
    m = Manifest.read(model)
    layer = 1
    e = m.experts[layer].cold[0]
    cold = m.layout_of((layer, e))
    raw = (model / m.experts[layer].file).read_bytes()[m.experts[layer].offsets[e] :][: cold.nbytes]
    wide = cold.widen(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    got = _records(model, m, layer)(e)
    assert all(torch.equal(got[k], v) for k, v in m.record.unpack(wide).items())
    for which in ("w1", "w3", "w2"):
        spans = cold.stored_from(lambda at, n: raw[at : at + n], which)
        assert all(torch.equal(a, b) for a, b in zip(spans, m.record.stored(wide, which), strict=True))
