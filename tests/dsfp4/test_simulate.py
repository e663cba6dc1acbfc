"""The store simulated (projection/simulate.py) and the whole-model projection on it (projection/whole_model.py):
resident records cost compute only, a store that holds nothing is bound by its links, prefetch with perfect
guesses hides what a store without it waits for, a prompt's experts come in waves of the device's slots, and the
whole model plans and projects on every machine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dsfp4.layout.recipe import ColdRecipe
from dsfp4.projection.bench_check import share_plan
from dsfp4.projection.first_token import first_token_table, first_tokens
from dsfp4.projection.machines import MACHINES
from dsfp4.projection.simulate import (
    IN_PLACE_SHARE,
    ColdRecords,
    HostStream,
    Links,
    StepCosts,
    SwapModel,
    simulate,
)
from dsfp4.projection.simulate_prefill import simulate_prefill
from dsfp4.projection.whole_model import (
    full_plan,
    machine_run,
    project,
    spread,
    step_bytes,
    step_flops,
    table,
)

COSTS = StepCosts(attn_s=1e-3, experts_s=2e-3, other_s=5e-3, host_s=0.0)
RECORD = 10_000_000


def _trace(tokens: int = 60, layers: int = 4, experts: int = 16, k: int = 2, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.choice(experts, k, replace=False) for _ in range(layers)]) for _ in range(tokens)])


def test_backbone_read_in_place_costs_its_bytes_over_the_link_the_copies_share():
    trace, links = _trace(), Links(1e9, 1e10)
    everything = [(layer, e) for layer in range(4) for e in range(16)]
    host = HostStream(frozenset({1, 3}), attn_bytes=3e7, experts_bytes=1e7, other_bytes=2e7)
    p = simulate(trace, 64, 64, RECORD, links, COSTS, "lru", None, 16, warm=everything, host=host)
    rate = 1e10 * IN_PLACE_SHARE  # every record resident: the link carries the backbone alone
    per_token = 2 * (max(3e7 / rate, 1e-3) + max(1e7 / rate, 2e-3)) + 2 * 3e-3 + max(2e7 / rate, 5e-3)
    assert p.seconds == pytest.approx(per_token) and p.pcie_bytes == pytest.approx(2 * 4e7 + 2e7)
    plain = simulate(trace, 64, 64, RECORD, links, COSTS, "lru", None, 16, warm=everything)
    assert plain.seconds < p.seconds and plain.pcie_bytes == 0
    # prefetched copies from RAM and the next layer's attention share the link: each waits for the other
    cold = simulate(trace, 8, 64, RECORD, links, COSTS, "lru", 1.0, 16, warm=everything[:64], host=host)
    alone = simulate(trace, 8, 64, RECORD, links, COSTS, "lru", 1.0, 16, warm=everything[:64])
    link = (alone.pcie_bytes + 1e8) / rate  # every byte the link carries, at its in-place rate or better
    assert cold.pcie_bytes == pytest.approx(alone.pcie_bytes + 1e8) and cold.seconds > max(alone.seconds, link)
    prefill = simulate_prefill(trace, 8, 64, RECORD, links, COSTS, 16, "lru", everything[:64], host)
    assert (
        prefill.pcie_bytes > simulate_prefill(trace, 8, 64, RECORD, links, COSTS, 16, "lru", everything[:64]).pcie_bytes
    )


def test_resident_records_cost_compute_only():
    trace = _trace()
    everything = [(layer, e) for layer in range(4) for e in range(16)]
    p = simulate(trace, 64, 64, RECORD, Links(1e9, 1e10), COSTS, "lru", None, 16, warm=everything)
    assert p.stall_s == 0 and p.ssd_bytes == 0 and p.device_hits == p.uses == 8
    assert p.seconds == pytest.approx(4 * 3e-3 + 5e-3) and p.tok_s == pytest.approx(1 / 17e-3)


def test_a_store_that_holds_nothing_waits_for_every_record_on_its_links():
    trace = _trace()
    links = Links(ssd=1e9, pcie=1e10)  # a record: 10 ms from the SSD, 1 ms over PCIe
    p = simulate(trace, 2, 2, RECORD, links, COSTS, "lru", None, 16)
    assert p.ssd_bytes == pytest.approx(8 * RECORD) and p.pcie_bytes == pytest.approx(8 * RECORD)
    # per layer: two reads (20 ms) then the last copy (1 ms) after the router
    assert p.stall_s == pytest.approx(4 * 21e-3) and p.seconds == pytest.approx(4 * 24e-3 + 5e-3)


def test_a_threshold_leaves_out_cold_choices_only_and_reads_less():
    trace = _trace(tokens=200)
    links = Links(ssd=1e9, pcie=1e10)
    exact = simulate(trace, 4, 8, RECORD, links, COSTS, "lru", None, 16, warmup=20)
    none = np.zeros(trace.shape, dtype=bool)
    assert simulate(trace, 4, 8, RECORD, links, COSTS, "lru", None, 16, warmup=20, skippable=none) == exact
    low = np.ones(trace.shape, dtype=bool)
    low[..., 0] = False  # a token's best stays
    p = simulate(trace, 4, 8, RECORD, links, COSTS, "lru", None, 16, warmup=20, skippable=low)
    assert p.skipped > 0 and p.uses + p.skipped == exact.uses == 8 and p.ssd_bytes < exact.ssd_bytes
    assert p.device_hits + p.ram_hits + p.ssd_misses == p.uses  # what is left out is never a hit nor a read
    everything = [(layer, e) for layer in range(4) for e in range(16)]
    warm = simulate(trace, 64, 64, RECORD, links, COSTS, "lru", None, 16, warm=everything, skippable=low)
    assert warm.skipped == 0  # nothing cold: nothing left out


def test_cache_aware_swaps_cold_choices_for_warm_ones_of_their_group_and_reads_less():
    trace = _trace(tokens=200)
    links = Links(ssd=1e9, pcie=1e10)
    exact = simulate(trace, 4, 8, RECORD, links, COSTS, "lru", None, 16, warmup=20)
    never = simulate(trace, 4, 8, RECORD, links, COSTS, "lru", None, 16, warmup=20, swap=SwapModel(4, 0.0))
    assert never == exact  # no expert scored close enough: exact routing
    p = simulate(trace, 4, 8, RECORD, links, COSTS, "lru", None, 16, warmup=20, swap=SwapModel(4, 1.0))
    assert p.swapped > 0 and p.uses == exact.uses and p.ssd_bytes < exact.ssd_bytes
    assert p.device_hits + p.ram_hits + p.ssd_misses == p.uses


def test_perfect_prefetch_keeps_the_ssd_busy_and_wrong_guesses_cost_reads():
    trace = _trace(tokens=200)
    links = Links(ssd=1e9, pcie=1e10)
    plain = simulate(trace, 8, 12, RECORD, links, COSTS, "lru", None, 16, warmup=20)
    perfect = simulate(trace, 8, 12, RECORD, links, COSTS, "lru", 1.0, 16, warmup=20)
    wrong = simulate(trace, 8, 12, RECORD, links, COSTS, "lru", 0.0, 16, warmup=20)
    assert perfect.seconds < plain.seconds and perfect.ssd_bytes == pytest.approx(plain.ssd_bytes, rel=0.1)
    assert wrong.ssd_bytes > plain.ssd_bytes and wrong.seconds > plain.seconds
    ram_only = simulate(trace, 8, 12, RECORD, links, COSTS, "lru", 0.0, 16, warmup=20, prefetch_reads=False)
    assert ram_only.ssd_bytes <= plain.ssd_bytes * 1.05  # guesses copied up from RAM only: no read wasted


def test_the_hot_policy_holds_its_warm_set():
    trace = _trace(tokens=200)
    warm = [(layer, e) for layer in range(4) for e in range(16)]
    p = simulate(trace, 2, 32, RECORD, Links(1e9, 1e10), COSTS, "hot", None, 16, warm=warm)
    assert p.ram_hits > 0


@pytest.mark.slow
def test_the_whole_model_plans_and_projects_on_every_machine():
    for family, machine in (("v3", "16g"), ("v3", "24g"), ("v3", "3090"), ("v4", "home-seek")):
        m, plan = full_plan(family, MACHINES[machine])
        assert plan.total_records == len([b for b in range(m.args.n_layers) if b in m.experts]) * 256
        assert plan.gpu_slots >= m.args.n_activated_experts and plan.ram_slots > 0
        attn, experts, other = step_bytes(m)
        assert attn > 0 and experts > m.args.n_activated_experts * m.record.nbytes and other > 0
    ids = _trace(tokens=40, layers=8, experts=256, k=8)
    rows = project("v3", ids, ["16g"], eff=0.7, variants=(("mix", None, True), ("hot", 1.0, True)))
    assert [r.policy for r in rows] == ["mix", "hot"] and all(0 < r.projection.tok_s < 100 for r in rows)
    assert "Belady SSD %" in table(rows) and spread(ids, 58).shape == (40, 58, 8)
    r = machine_run("v3", "16g", ids, 0.7)
    plan, cold = r.narrowed(2, hot_share=0.1)  # V3's 16g RAM budget split for 2-bit cold records
    assert plan.record_cache <= r.plan.record_cache and plan.ram_slots > 1.3 * r.plan.ram_slots
    assert plan.cold_slots == cold.slots > 0 and len(cold.keys) == 58 * (256 - 26)
    assert r.narrowed(2)[0].cold_slots == 0  # profile-hot's default hot set fills RAM at full size: no split
    # a recipe: each layer's cold records at its size, narrow slots of the largest; its bytes between 2 and 3 bits'
    recipe = ColdRecipe.parse("gate=2,up=2,down=3;3-5:down=4")
    plan_r, cold_r = r.narrowed(recipe, hot_share=0.1)
    sizes = {m: r.m.record.cold_of(b).nbytes for m, b in (("low", (2, 2, 3)), ("first", (2, 2, 4)))}
    assert cold_r.keys == cold.keys and cold_r.nbytes == sizes["first"] and cold_r.size((0, 0)) == sizes["first"]
    assert cold_r.size((3, 0)) == sizes["low"] and plan_r.cold_record == sizes["first"]
    assert r.routed_bits(2, 0.1) < r.routed_bits(recipe, 0.1) < r.routed_bits(3, 0.1) < r.routed_bits(None)
    assert r.routed_bits(ColdRecipe.uniform(2), 0.1) == r.routed_bits(2, 0.1)


def test_a_card_that_shares_a_presets_budgets_is_projected_beside_it():
    from dsfp4.projection.machines import on_presets

    assert on_presets(["16g"]) == ["16g"] and on_presets(["24g", "16g"]) == ["24g", "16g", "3090"]
    assert MACHINES["3090"].budgets == MACHINES["24g"].budgets and MACHINES["3090"].flops < MACHINES["24g"].flops


def test_a_card_on_the_by_bits_path_decodes_at_its_measured_share(monkeypatch):
    from dsfp4.projection.machines import BY_BITS_DECODE

    ids = _trace(tokens=40, layers=8, experts=256, k=8)
    monkeypatch.setitem(MACHINES, "3090 native", dataclasses.replace(MACHINES["3090"], path_speed=1.0))
    by_bits, native = machine_run("v3", "3090", ids, 0.7), machine_run("v3", "3090 native", ids, 0.7)
    assert MACHINES["3090"].path_speed == BY_BITS_DECODE < 1 and MACHINES["24g"].path_speed == 1
    assert by_bits.costs.attn_s == pytest.approx(native.costs.attn_s / BY_BITS_DECODE)
    assert by_bits.decode("hot", 0.9, True).tok_s < native.decode("hot", 0.9, True).tok_s


def test_a_card_on_the_by_bits_path_prefills_its_fp8_backbone_at_its_measured_share():
    from dsfp4.projection.first_token import prefill_costs
    from dsfp4.projection.machines import BY_BITS_PREFILL, NATIVE_FP8_PREFILL
    from dsfp4.projection.whole_model import full_plan

    native = dataclasses.replace(MACHINES["3090"], fp8_prefill=NATIVE_FP8_PREFILL)
    m, _ = full_plan("v3", MACHINES["3090"])
    by_bits, same_card = prefill_costs(m, MACHINES["3090"]), prefill_costs(m, native)
    # widened for cuBLAS, the by-bits prefill GEMMs outran the native W8A8 ones on the H200
    assert MACHINES["3090"].fp8_prefill == BY_BITS_PREFILL > NATIVE_FP8_PREFILL == MACHINES["24g"].fp8_prefill
    # the backbone's matrices faster by the paths' ratio, the experts' unchanged
    assert by_bits.attn_s == pytest.approx(same_card.attn_s * NATIVE_FP8_PREFILL / BY_BITS_PREFILL)
    assert by_bits.other_s < same_card.other_s and by_bits.experts_s == same_card.experts_s


def test_share_plan_keeps_one_layer_on_the_device():
    from dsfp4.runtime.plan.budget import Budgets
    from dsfp4.runtime.plan.planner import Plan

    plan = Plan("cuda", Budgets(1, 1, "x"), 0, 0, 0, 100, 50, 60, 4, 0, 1024, (1, 2, 3, 4))
    p = share_plan(plan, 0.002, 0.23, top_k=8)
    assert (p.gpu_slots, p.ram_slots) == (8, 236)


PROMPT = np.array([[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]])  # [4 tokens, 1 layer, K = 2]: 8 distinct experts


def test_a_prompt_whose_records_are_resident_costs_its_compute():
    warm = [(0, e) for e in range(8)]
    p = simulate_prefill(PROMPT, 8, 8, RECORD, Links(1e9, 1e10), COSTS, chunk=4, policy="lru", warm=warm)
    assert p.ssd_bytes == p.pcie_bytes == 0 and p.device_hits == p.uses == 8
    assert p.seconds == pytest.approx(4 * (1e-3 + 2e-3 + 5e-3)) == p.compute_s


def test_a_prompt_brings_its_experts_in_waves_of_the_device_slots():
    """4 device slots for 8 experts: the second wave's reads queue behind the first's (10 ms a read) and its copies
    (1 ms) wait for the first wave's compute (half the chunk's routed compute, 4 ms) to free the slots."""
    p = simulate_prefill(PROMPT, 4, 8, RECORD, Links(1e9, 1e10), COSTS, chunk=4, policy="lru")
    assert p.ssd_bytes == 8 * RECORD and p.ssd_misses == 8 and p.tokens == 4
    # router at 4 ms; wave 1 ready at 4 + 4 x 10 + 1 = 45, computes to 49; wave 2's reads 45 -> 85, last copy 86,
    # computes to 90; then the dense layers and head, 4 x 5 ms
    assert p.seconds == pytest.approx(0.110) and p.stall_s == pytest.approx(0.041 + 0.037)


def test_each_chunk_brings_again_what_the_ram_could_not_keep():
    prompt = np.concatenate([PROMPT, PROMPT])  # the same 8 experts in each of two chunks
    small = simulate_prefill(prompt, 4, 4, RECORD, Links(1e9, 1e10), COSTS, chunk=4, policy="lru")
    large = simulate_prefill(prompt, 4, 8, RECORD, Links(1e9, 1e10), COSTS, chunk=4, policy="lru")
    one = simulate_prefill(prompt, 4, 4, RECORD, Links(1e9, 1e10), COSTS, chunk=8, policy="lru")
    # the second chunk finds the last wave's 4 on the device; the rest come again from the SSD, or from a RAM of 8,
    # which holds the layer: its 8 records read ahead once as the pass reaches it, each use then a RAM hit
    assert (small.device_hits, small.ssd_misses, small.ssd_bytes) == (4, 12, 12 * RECORD)
    assert (large.ram_hits, large.ssd_misses, large.ssd_bytes) == (12, 0, 8 * RECORD)
    assert one.ssd_misses == 8 and one.uses == 8  # one chunk of 8 tokens: each expert brought once


def test_a_layer_wise_pass_reads_the_next_layers_records_while_this_one_computes():
    """Where RAM holds a layer's records, the pass reads them ahead as it reaches the layer, and what RAM holds of the
    next layer's behind them (layer_pass.py): the reads of layer 1 overlap layer 0's compute, so the prompt takes less
    than its reads and its compute one after another, each record read once."""
    trace = _trace(tokens=64, layers=2, experts=16, k=2)  # every expert of both layers used
    links = Links(ssd=1e9, pcie=1e11)
    costs = StepCosts(attn_s=1e-3, experts_s=3e-3, other_s=0.0, host_s=0.0)
    both = simulate_prefill(trace, 4, 32, RECORD, links, costs, chunk=16, group=64)
    reads = 32 * RECORD / links.ssd
    assert both.ssd_bytes == 32 * RECORD and both.ssd_misses == 0
    assert max(reads, both.compute_s) <= both.seconds < reads + both.compute_s


@pytest.mark.slow
def test_the_whole_model_projects_its_first_token():
    m, _ = full_plan("v3", MACHINES["16g"])
    attn, experts, other = step_flops(m)
    assert 2 * 36e9 < 58 * (attn + experts) + other < 2 * 38e9  # DeepSeek-V3: 37B parameters active per token
    ids = _trace(tokens=40, layers=8, experts=256, k=8)
    rows = first_tokens("v3", ids, ["16g"], prompts=(16, 600))
    short, long = (r.projection for r in rows)
    assert 0 < short.seconds < long.seconds and long.ssd_bytes > short.ssd_bytes > 0
    assert "TTFT s" in first_token_table(rows)


def test_a_batch_brings_the_union_of_its_sequences_experts_each_step():
    """MachineRun.decode_batch: b stretches of the trace decode together; a step brings their union in and costs one
    token's compute, so with nothing to read (resident) b sequences decode b times one's tokens per second."""
    from dsfp4.projection.whole_model import machine_run

    ids = _trace(tokens=64, layers=8, experts=256, k=8)
    r = machine_run("v3", "16g", ids, 0.7)
    one, four = r.decode_batch(1), r.decode_batch(4)
    steps = len(r.run) // 4
    assert one.tokens == len(r.run) and four.tokens == 4 * steps
    assert four.uses / (steps * r.run.shape[1]) <= 4 * 8 and one.uses == len(r.run) * r.run.shape[1] * 8
    held = dataclasses.replace(r, plan=dataclasses.replace(r.plan, gpu_slots=r.plan.total_records, ram_slots=0))
    warm = dataclasses.replace(held, warm=[(layer, e) for layer in range(r.run.shape[1]) for e in range(256)])
    solo, batch = warm.decode_batch(1), warm.decode_batch(4)
    assert batch.ssd_bytes == solo.ssd_bytes == 0
    assert batch.tokens / batch.seconds == pytest.approx(4 * solo.tokens / solo.seconds, rel=0.02)


def test_the_cpu_lane_takes_ram_hits_off_the_link_and_is_bound_by_its_own_rate():
    """Every record in RAM, 2 device slots: all of a layer's experts cross PCIe. The lane takes its share of them
    (RAM hits) at the cores' rate; none without a cpu rate or a share, and a slow CPU makes the step slower."""
    trace = _trace(k=4)
    everything = [(layer, e) for layer in range(4) for e in range(16)]
    fast, alone = Links(1e9, 1e9, cpu=1e9), Links(1e9, 1e9)
    base = simulate(trace, 4, 64, RECORD, alone, COSTS, "lru", None, 16, warm=everything)
    lane = simulate(trace, 4, 64, RECORD, fast, COSTS, "lru", None, 16, warm=everything, host_share=0.5)
    assert base.host_computed == 0 and 0 < lane.host_computed <= lane.ram_hits
    assert lane.pcie_bytes == pytest.approx(base.pcie_bytes - lane.host_computed * RECORD)
    assert lane.seconds < base.seconds  # two links' worth of records a step instead of one
    for links, share in ((alone, 0.5), (fast, 0.0)):  # no cpu rate, or no share: the store as without the lane
        same = simulate(trace, 4, 64, RECORD, links, COSTS, "lru", None, 16, warm=everything, host_share=share)
        assert same.seconds == base.seconds and same.host_computed == 0
    slow = simulate(
        trace, 4, 64, RECORD, Links(1e9, 1e9, cpu=1e8), COSTS, "lru", None, 16, warm=everything, host_share=0.5
    )
    assert slow.seconds > base.seconds


def test_the_adaptive_threshold_leaves_out_only_what_copies_cannot_hide():
    """hide_ratio 0: every skippable cold choice goes, as a fixed threshold's; the larger the ratio, the more reads a
    layer's copies of RAM hits hide and the fewer go (a layer with no copy hides none)."""
    trace = _trace(k=4)
    low = np.zeros(trace.shape, dtype=bool)
    low[..., 1:] = True  # every choice but the best is below the threshold

    def run(ratio: float | None):
        return simulate(trace, 4, 24, RECORD, Links(1e9, 1e10), COSTS, "lru", None, 16, skippable=low, hide_ratio=ratio)

    fixed = run(None)
    assert run(0.0).skipped == fixed.skipped > 0
    assert 0 < run(100.0).skipped < run(1.0).skipped < fixed.skipped


def test_narrow_ram_slots_hold_more_cold_records_in_the_same_bytes_and_read_less():
    """Cold records of half a record's size: RAM split as the planner splits it holds more of them than record-sized
    slots of the same bytes, so fewer uses go to the SSD; the cold ones only ever take narrow slots."""
    trace, links = _trace(tokens=120), Links(1e9, 1e10)
    keys = [(layer, e) for layer in range(4) for e in range(16)]
    cold = frozenset(k for k in keys if k[1] >= 4)  # 12 of each layer's 16 experts
    warm = sorted(keys, key=lambda k: k[1])
    wide = simulate(trace, 4, 24, RECORD, links, COSTS, "lru", None, 16, warm=warm, cold=ColdRecords(cold, RECORD // 2))
    split = ColdRecords(cold, RECORD // 2, slots=32)  # the same bytes: 8 record slots and 32 of half the size
    narrow = simulate(trace, 4, 40, RECORD, links, COSTS, "lru", None, 16, warm=warm, cold=split)
    assert narrow.ssd_misses < wide.ssd_misses and narrow.ssd_bytes < wide.ssd_bytes
    assert narrow.ram_hits > wide.ram_hits


def test_a_streamed_prompt_reads_each_record_once_and_a_batchs_decode_steps_do_not():
    """RAM holds one layer's records: the prompt's chunks go through a layer before the next (the decoder's order),
    a batch's decode steps one after another through every layer (each needs the token of the one before)."""
    trace, links = _trace(tokens=64), Links(ssd=1e9, pcie=1e10)
    prompt = simulate_prefill(trace, 4, 16, RECORD, links, COSTS, chunk=8)
    steps = simulate_prefill(trace, 4, 16, RECORD, links, COSTS, chunk=8, decode_steps=True)
    assert prompt.ssd_bytes <= 4 * 16 * RECORD < steps.ssd_bytes
    assert prompt.compute_s == steps.compute_s and prompt.seconds < steps.seconds


def test_a_streamed_prompts_group_brings_each_record_to_the_device_once():
    """4 device slots, 16 experts a layer: chunk by chunk each chunk copies its layer's experts again; a group of the
    whole prompt copies each (layer, expert) once, as layer_pass.py does."""
    trace, links = _trace(tokens=64), Links(ssd=1e9, pcie=1e10)
    chunks = simulate_prefill(trace, 4, 16, RECORD, links, COSTS, chunk=8)
    grouped = simulate_prefill(trace, 4, 16, RECORD, links, COSTS, chunk=8, group=64)
    distinct = sum(len(np.unique(trace[:, layer])) for layer in range(trace.shape[1]))
    assert grouped.pcie_bytes == distinct * RECORD < chunks.pcie_bytes
    assert grouped.ssd_bytes == chunks.ssd_bytes and grouped.seconds < chunks.seconds


def test_attention_against_earlier_positions_adds_its_seconds_to_the_prompts_compute():
    # records quick to come, so that the prompt's compute shows in its time to first token
    trace, links = _trace(tokens=32), Links(ssd=1e11, pcie=1e11)
    context = np.arange(32) * 1e-4  # [P] seconds a token at each position, per MoE layer
    plain = simulate_prefill(trace, 4, 16, RECORD, links, COSTS, chunk=8, group=32)
    longer = simulate_prefill(trace, 4, 16, RECORD, links, COSTS, chunk=8, group=32, context_s=context)
    assert longer.compute_s == pytest.approx(plain.compute_s + trace.shape[1] * context.sum())
    assert longer.seconds > plain.seconds


def test_a_layer_wise_pass_moves_its_hidden_states_over_the_link_and_the_chunk_order_does_not():
    """Streamed: every token's hidden state crosses the link each MoE layer (to the device and back); where every
    record is resident the chunks go through every block in turn, on the device."""
    # a quick disk: the link binds
    trace, links = _trace(tokens=32), Links(ssd=1e12, pcie=1e9)
    hidden = HostStream(hidden_bytes=4e6)
    plain = simulate_prefill(trace, 4, 16, RECORD, links, COSTS, chunk=8, group=32)
    crossing = simulate_prefill(trace, 4, 16, RECORD, links, COSTS, chunk=8, group=32, host=hidden)
    assert crossing.pcie_bytes == pytest.approx(plain.pcie_bytes + 32 * trace.shape[1] * 4e6)
    assert crossing.seconds > plain.seconds
    resident = [(layer, e) for layer in range(trace.shape[1]) for e in range(16)]
    on_device = simulate_prefill(trace, len(resident), 0, RECORD, links, COSTS, 8, "lru", resident, hidden)
    assert on_device.pcie_bytes == 0


@pytest.mark.slow
def test_decode_at_a_long_context_reads_its_caches_and_keeps_the_backbone_on_the_16g_card():
    from dsfp4.projection.long_context import context_decodes, context_table

    ids = _trace(tokens=48, layers=8, experts=256, k=8)
    short, long = context_decodes("v3", ids, ["16g"], 0.5, (1024, 32768))
    assert long.ram_cache_bytes > 0 and long.host_backbone == 0 and long.cache_s > short.cache_s
    assert 0.8 * short.tok_s < long.tok_s < short.tok_s
    assert "cache in RAM GB" in context_table([short, long])


def test_the_routed_experts_prefill_at_the_kernels_share_for_the_rows_a_wave_call_gives_an_expert():
    import torch

    from dsfp4.kernels.moe.waves import call_rows
    from dsfp4.projection.first_token import EXPERT_ROW_SHARES, PREFILL_SHARE, expert_share, prefill_costs, wave_rows
    from dsfp4.projection.whole_model import full_plan

    (lo, lo_share), (hi, hi_share) = EXPERT_ROW_SHARES[0], EXPERT_ROW_SHARES[-1]
    assert expert_share(lo) == pytest.approx(lo_share) and expert_share(hi) == hi_share == PREFILL_SHARE
    assert expert_share(1) == expert_share(lo) and expert_share(10 * hi) == PREFILL_SHARE  # flat outside
    assert lo_share < expert_share(24) < EXPERT_ROW_SHARES[1][1]
    m, _ = full_plan("v3", MACHINES["16g"])
    # V3 on 16 GB at 32k: 17 device slots in waves of 8 (store/waves.py), a group of 11,776 tokens -> 368 pairs an
    # expert, in runs by expert that a chunk's workspace holds (call_rows): most experts whole in a call; so too a
    # wave of every expert (24 GB's)
    pairs = 11776 * 8 * 8 / 256
    rows = wave_rows(m, 32768, 11776, 512, 17)
    assert rows == call_rows(m.record, 8, 256, 512, 8, pairs, torch.bfloat16, False)[0] and 250 < rows <= 368
    assert 250 < wave_rows(m, 32768, 11776, 512, 300) <= 368
    # too few pairs to fill more rows: a chunk's calls over all of them
    assert wave_rows(m, 100, 11776, 512, 256) == pytest.approx(100 * 8 / 256)
    few, many = prefill_costs(m, MACHINES["16g"], lo), prefill_costs(m, MACHINES["16g"], hi)
    assert few.experts_s > 2 * many.experts_s and few.attn_s == many.attn_s and few.other_s == many.other_s


def test_a_prompts_waves_of_half_the_slots_copy_while_the_one_before_computes_and_the_host_queues_each_beside():
    """A 40-token chunk (compacted) over 8 experts of one layer, in RAM, with 4 device slots: waves of 2, each's
    copies overlapping the compute before it, so the prompt takes less than its copies and compute one after the
    other. The host's wave_s, queuing each wave while the device computes the one before, hides behind that compute
    where it is shorter (but for the first wave's) and binds where it is longer; a step that one wave holds has
    none."""
    trace = np.array([[[e % 8 for e in range(t, t + 2)]] for t in range(40)])  # [40, 1, 2]: 8 experts
    warm = [(0, e) for e in range(8)]
    links = Links(1e9, 1e9)
    copy_s = RECORD / links.pcie
    costs = StepCosts(0.0, 8 * copy_s / 40, 0.0)  # the chunk's routed compute: 8 copies' time

    def run(slots: int, c: StepCosts) -> float:
        return simulate_prefill(trace, slots, 8, RECORD, links, c, 40, "lru", warm).seconds

    serial = 8 * copy_s + 8 * copy_s
    assert run(4, costs) < 0.8 * serial
    # a wave's compute: 2 copies' time
    hidden = run(4, dataclasses.replace(costs, wave_s=0.5 * copy_s))
    assert run(4, costs) < hidden <= run(4, costs) + 0.5 * copy_s * 1.001
    assert 4 * 0.5 < run(4, dataclasses.replace(costs, wave_s=0.5)) < 4 * 0.5 + 3 * copy_s
    assert run(8, dataclasses.replace(costs, wave_s=0.5)) == pytest.approx(run(8, costs))
