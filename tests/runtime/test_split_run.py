"""A run split across two cards (--devices) takes the whole split path on one device named twice (`cpu,cpu` here,
`cuda:0,cuda:0` in the gpu test): each card its layers, caches, expert slots and transfers over one RAM tier, the
hidden state copied at the cut. Greedy tokens and logits equal the one-device run's; MTP, batching, the prompt cache
and the lossy levers run across the cut; a long prompt's chunks take compacted waves on each card."""

from __future__ import annotations

import pytest
import torch

from dsfp4 import Engine
from dsfp4.errors import ConfigError
from dsfp4.kernels.moe import waves
from dsfp4.kernels.token_bounds import DECODE_TOKENS
from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.plan.budget import Budgets
from dsfp4.runtime.plan.device_split import make_split_plan
from dsfp4.runtime.plan.host_backbone import EMBED, layer_bytes, tensor_bytes
from dsfp4.runtime.plan.planner import COMPLEX64, Plan, cache_slots, layer_cache_bytes, make_plan
from dsfp4.runtime.store.split_store import SplitStore

CPU = torch.device("cpu")
CONTEXT, CHUNK = 128, 16
PROMPT = "Why does dsfp4 stream experts from the SSD? " * 3
FP32 = 4


def split_plan(
    model, devices: list[torch.device], slots: int, first_layers: int, ram: int = 1 << 30, chunk: int = CHUNK, **kw
) -> tuple[Plan, list[int]]:
    """A plan of two cards whose budgets hold the first `first_layers` layers on card 0 and the rest on card 1, with
    `slots` expert slots each (where its layers have records) and `ram` bytes of RAM -> (plan, each card's layers)."""
    m, with_mtp, batch = Manifest.open(model), kw.get("with_mtp", False), kw.get("max_batch", 1)
    a = m.args
    one = make_plan(m, devices[0], torch.float32, Budgets(1 << 30, ram, "t"), CONTEXT, chunk, 2, process=0, **kw)
    used = range(a.n_blocks if with_mtp else a.n_layers)
    weights = layer_bytes(m, FP32, used)
    size = {i: weights[i] + cache_slots(batch) * sum(layer_cache_bytes(a, i, CONTEXT, FP32)) for i in used}
    rope = a.family_spec.rope_tables * CONTEXT * (a.qk_rope_head_dim // 2) * COMPLEX64
    embed = tensor_bytes(EMBED, m.tensors[EMBED], FP32)
    head = one.backbone - sum(weights.values()) - embed
    each = one.workspace + rope + slots * one.record
    first = one.host_base * (devices[0].type == "cpu") + embed + sum(size[i] for i in used if i < first_layers)
    last = head + sum(size[i] for i in used if i >= first_layers)
    budgets = (each + first, each + last)
    plan = make_split_plan(
        m, devices, torch.float32, Budgets(sum(budgets), ram, "t", budgets), CONTEXT, chunk, 2, process=0, **kw
    )
    return plan, [list(c.layers) for c in plan.cards]


def engine(model, plan: Plan | None, devices: str | None = None, chunk: int = CHUNK, **knobs) -> Engine:
    where = {"devices": devices} if devices else {"device": "cpu"}
    return Engine(model, plan=plan, max_context=CONTEXT, prefill_chunk=chunk, cuda_graph=False, **where, **knobs)


def run(e: Engine, prompts: list[str], n: int = 8) -> list[list[int]]:
    return [e.generate(p, max_tokens=n, temperature=0).token_ids for p in prompts]


@pytest.fixture(scope="module")
def alone(converted) -> tuple[list[list[int]], torch.Tensor]:
    """The one-device run's greedy tokens (a short prompt, then a long one prefilled layer by layer) and logits."""
    m = Manifest.open(converted)
    plan = make_plan(m, CPU, torch.float32, Budgets(1 << 30, 1 << 30, "t"), CONTEXT, CHUNK, 2, process=0)
    with engine(converted, plan) as e:
        return run(e, ["Hi", PROMPT]), e.logits(list(range(40)))


@pytest.mark.parametrize("slots", [3, 8])
def test_split_greedy_tokens_and_logits_equal_one_devices(converted, alone, slots):
    """3 slots a card: both cards stream their layers' experts (the long prompt layer by layer), a prefetch crossing
    the cut to the next card's store; 8: every record on its card."""
    plan, layers = split_plan(converted, [CPU, CPU], slots, first_layers=2)
    assert layers == [[0, 1], [2]]
    with engine(converted, plan, "cpu,cpu") as e:
        store = e.model.experts
        assert isinstance(store, SplitStore) and [s.plan.gpu_slots for s in store.cards] == [slots, slots]
        # each card's blocks on its card, its MoE layers asking its own store; one RAM tier
        assert [b.ffn.experts for b in e.model.layers[1:]] == store.cards
        assert store.cards[1].ram_pool is store.cards[0].ram_pool and store.cards[1].cache is store.cards[0].cache
        assert run(e, ["Hi", PROMPT]) == alone[0]
        logits = e.logits(list(range(40)))
        # streamed waves of a chunk add in another order (fp32): equal to rounding; resident ones bit for bit
        assert torch.equal(logits, alone[1]) if slots == 8 else torch.allclose(logits, alone[1], atol=1e-5)
        counts = e.stats.store
        assert counts["expert_uses"] > 0
        if slots < 8:
            assert counts["ssd_reads"] + counts["ram_hits"] > 0
            assert store.cards[1]._counters is store.cards[0]._counters


def test_a_split_prompt_takes_compacted_waves_on_each_card(converted, monkeypatch):
    """Chunks past decode's tokens (kernels/moe/waves.py compacts) with 3 slots a card: each card's waves compute
    only the pairs of the experts its store brought, summed in fp32: the logits of the one-device resident run to
    fp32 rounding, and its greedy tokens."""
    from dsfp4.runtime.models import moe

    chunk, slots_of = DECODE_TOKENS + 4, []
    real = moe.add_wave
    monkeypatch.setattr(moe, "add_wave", lambda *a: slots_of.append(a[4].data_ptr()) or real(*a))
    with engine(converted, None) as whole:
        ids = (whole.encode(PROMPT) * 2)[: 2 * chunk + 7]
        expected = whole.logits(ids)
        resident = whole.generate(ids, max_tokens=6, temperature=0).token_ids
    assert not slots_of and waves.compacts(chunk, None)
    plan, _ = split_plan(converted, [CPU, CPU], 3, first_layers=2, chunk=chunk)
    with engine(converted, plan, "cpu,cpu", chunk=chunk) as e:
        torch.testing.assert_close(e.logits(ids), expected, rtol=1e-4, atol=1e-4)
        assert set(slots_of) == {s.gpu.data_ptr() for s in e.model.experts.cards}
        assert e.generate(ids, max_tokens=6, temperature=0).token_ids == resident


def test_a_split_with_the_mtp_layer_on_the_last_card(converted, alone):
    plan, layers = split_plan(converted, [CPU, CPU], 3, first_layers=2, with_mtp=True)
    a = Manifest.open(converted).args
    assert layers[-1][-1] == a.n_layers
    with engine(converted, plan, "cpu,cpu", mtp=True) as e:
        e.speculator.adaptive, e.speculator.probe_plain = False, 0
        assert run(e, ["Hi", PROMPT]) == alone[0]
        assert e.stats.drafted > 0


def test_a_split_batch_equals_each_sequence_alone(converted, alone):
    plan, _ = split_plan(converted, [CPU, CPU], 3, first_layers=2, max_batch=2)
    with engine(converted, plan, "cpu,cpu", max_batch=2) as e:
        requests = [(e.encode(p), e.options_for(max_tokens=8, temperature=0.0)) for p in ("Hi", PROMPT)]
        got = {i: g.token_ids for i, g in e.generate_batch(requests)}
    assert [got[0], got[1]] == alone[0]


def test_a_split_saves_and_restores_prompt_caches(converted, alone, tmp_path):
    plan, _ = split_plan(converted, [CPU, CPU], 3, first_layers=2)
    with engine(converted, plan, "cpu,cpu", prompt_cache=tmp_path) as e:
        assert run(e, [PROMPT]) == [alone[0][1]]
    with engine(converted, plan, "cpu,cpu", prompt_cache=tmp_path) as e:
        assert run(e, [PROMPT]) == [alone[0][1]]
        assert e.stats.restored_tokens > 0


def test_the_lossy_levers_apply_on_each_card(converted):
    """Few RAM slots: records come from the SSD, and the threshold leaves cold ones out on both cards."""
    m = Manifest.open(converted)
    plan, _ = split_plan(converted, [CPU, CPU], 2, first_layers=2, ram=4 * m.record.nbytes)
    with engine(converted, plan, "cpu,cpu", expert_threshold=0.9, cache_aware=0.5) as e:
        tokens = run(e, [PROMPT], n=6)[0]
        assert len(tokens) == 6
        assert e.stats.store["skipped"] > 0


def test_v4_and_tied_heads_are_refused_in_one_line(v4_converted):
    with pytest.raises(ConfigError, match="does not split across cards yet; give one --device") as err:
        Engine(v4_converted, devices="cpu,cpu", max_context=CONTEXT)
    assert "\n" not in str(err.value)


@pytest.mark.gpu
def test_the_same_card_named_twice_runs_the_split_path_with_graphs(converted):
    cuda = torch.device("cuda:0")
    m = Manifest.open(converted)
    # the RAM budget above what a CUDA process holds (the planner counts 3.25 GiB for its runtime)
    ram = 8 << 30
    single = make_plan(m, cuda, torch.bfloat16, Budgets(1 << 30, ram, "t"), CONTEXT, CHUNK, 2, process=0)
    plan, layers = split_plan(converted, [cuda, cuda], 3, first_layers=2, ram=ram)
    assert layers == [[0, 1], [2]]
    knobs = {"max_context": CONTEXT, "prefill_chunk": CHUNK}
    with Engine(converted, plan=single, device="cuda:0", **knobs) as e:
        want = [e.generate(p, max_tokens=8, temperature=0).token_ids for p in ("Hi", PROMPT)]
    with Engine(converted, plan=plan, devices="cuda:0,cuda:0", **knobs) as e:
        assert e.decode_mode.startswith("CUDA graph"), e.decode_mode
        assert [e.generate(p, max_tokens=8, temperature=0).token_ids for p in ("Hi", PROMPT)] == want
