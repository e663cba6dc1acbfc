"""A run split across cards (--devices): the flags' refusals, each card's budget, and the planner's cut of the layers
by bytes (runtime/plan/devices.py, runtime/plan/device_split.py)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from dsfp4.cli.main import cli
from dsfp4.errors import ConfigError
from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.plan.budget import PRESETS, Budgets
from dsfp4.runtime.plan.device_split import make_split_plan
from dsfp4.runtime.plan.devices import card_budgets, resolve_cards
from dsfp4.runtime.plan.planner import make_plan

MiB = 1 << 20
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"devices": ""}, "--devices '': an empty name"),
        ({"devices": "cuda:0,,cuda:1"}, "an empty name"),
        ({"devices": "cuda:0"}, "a split takes 2 or more cards; give one with --device"),
        ({"devices": "cuda:0,cuda:1", "device": "cuda:0"}, "--devices with --device cuda:0"),
        ({"devices": "cpu,cuda:0"}, "give CUDA cards only"),
        ({"devices": "mps,mps"}, "give CUDA cards only"),
        ({"gpu_mem": "2G,2G"}, "--gpu-mem 2G,2G gives 2 budgets, one per card, but one device runs"),
        ({"devices": "cpu,cpu", "gpu_mem": "1G,2G,3G"}, "gives 3 budgets, one per card, but --devices names 2"),
        ({"preset": "2x24g"}, "--preset 2x24g is a machine of 2 cards: name them with --devices"),
        ({"devices": "cpu,cpu,cpu", "preset": "2x16g"}, "--preset 2x16g is a machine of 2 cards"),
    ],
)
def test_device_lists_are_refused_in_one_line(knobs, message):
    with pytest.raises(ConfigError, match=None) as e:
        RunOptions(**knobs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_budgets_per_card_from_one_size_a_list_or_a_two_card_preset():
    assert RunOptions(devices="cpu,cpu", gpu_mem="2G").budgets.cards == (2 << 30, 2 << 30)
    assert RunOptions(devices=("cpu", "cpu"), gpu_mem="2G,3G").budgets.cards == (2 << 30, 3 << 30)
    b = RunOptions(devices="cuda:0,cuda:1", preset="2x24g").budgets
    assert b.cards == (PRESETS["24g"].gpu,) * 2 and b.gpu == 2 * PRESETS["24g"].gpu and b.cpu == PRESETS["24g"].cpu
    # a one-card preset gives each card its size
    assert RunOptions(devices="cuda:0,cuda:1", preset="16g").budgets.cards == (PRESETS["16g"].gpu,) * 2
    assert RunOptions(devices="cpu,cpu").budgets.cards == (None, None)
    assert RunOptions(devices="cpu,cpu").devices == ("cpu", "cpu")


def test_a_device_named_twice_shares_it_and_must_fit_it():
    cards = resolve_cards(("cpu", "cpu"))
    assert cards == [CPU, CPU]
    free = card_budgets(Budgets(None, None, "", (None, None)), cards)
    # the names share the device's free memory evenly
    assert free.cards[0] == free.cards[1] > 0 and free.gpu == sum(free.cards)
    one = card_budgets(Budgets(None, None, "", (MiB, None)), cards)
    assert one.cards[0] == MiB and one.cards[1] >= free.cards[1]
    with pytest.raises(ConfigError, match=r"names cpu 2 times: its budgets .* do not fit") as e:
        card_budgets(Budgets(None, None, "", (1 << 50, 1 << 50)), cards)
    assert "\n" not in str(e.value)


def test_a_missing_card_is_refused_in_one_line():
    # one past this machine's cards (none: CUDA is missing altogether)
    missing = f"cuda:0,cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 1}"
    with pytest.raises(ConfigError, match=r"^--devices cuda:0,cuda:\d+: ") as e:
        resolve_cards(tuple(missing.split(",")))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="name each card with its index"):
        resolve_cards(("cuda", "cuda"))


def _split(converted, budgets: tuple[int, ...], **kw):
    m = Manifest.open(converted)
    b = Budgets(sum(budgets), 4 << 30, "test", budgets)
    return m, make_split_plan(m, [CPU] * len(budgets), torch.float32, b, 256, 64, 2, process=0, **kw)


def test_the_cut_keeps_every_card_within_its_budget_and_every_layer_once(converted):
    one = make_plan(
        Manifest.open(converted), CPU, torch.float32, Budgets(64 * MiB, 4 << 30, "t"), 256, 64, 2, process=0
    )
    # the first card holds the embedding and a workspace: the second takes the layers it cannot, and all the slots
    small = one.host_base + one.workspace + one.kv_cache + one.backbone // 2
    m, plan = _split(converted, (small, 64 * MiB))
    a = m.args
    assert [i for c in plan.cards for i in c.layers] == list(range(a.n_layers))
    assert plan.cards[0].layers and plan.cards[1].layers
    for c in plan.cards:
        used = c.backbone + c.kv_cache + c.workspace + c.gpu_slots * plan.record
        assert used <= c.budget
        assert c.gpu_slots <= c.records == len(c.expert_layers) * a.n_routed_experts
    assert plan.gpu_slots == sum(c.gpu_slots for c in plan.cards)
    assert plan.backbone == one.backbone
    # each card holds its own RoPE tables
    assert plan.kv_cache > one.kv_cache
    # the MTP layer goes on the last card, with the head
    _, mtp = _split(converted, (small, 64 * MiB), with_mtp=True)
    assert a.n_layers in mtp.cards[-1].layers


def test_the_cut_balances_slots_per_moe_layer(converted):
    """With room for some records only, the card of fewest slots per MoE layer has as many as any cut allows."""
    m, wide = _split(converted, (64 * MiB, 64 * MiB))
    one = make_plan(m, CPU, torch.float32, Budgets(64 * MiB, 4 << 30, "t"), 256, 64, 2, process=0)
    each = one.backbone + one.kv_cache + one.workspace + 3 * one.record
    _, tight = _split(converted, (each, each))
    per_layer = [c.gpu_slots / len(c.expert_layers) for c in tight.cards if c.expert_layers]
    assert min(per_layer) >= 1
    assert wide.gpu_slots == wide.total_records


def test_cards_short_of_the_backbone_are_refused_naming_the_bytes(converted):
    with pytest.raises(ConfigError, match=r"--devices: the cards' budgets .* cannot hold this model's layers") as e:
        _split(converted, (MiB, MiB))
    assert "\n" not in str(e.value)


def test_run_plan_shows_each_cards_layers_and_slots(converted):
    # on the CPU the first card's budget holds the process too, which a long test run grows past 1 GiB
    args = ["run", str(converted), "--devices", "cpu,cpu", "--gpu-mem", "3G,3G", "--cpu-mem", "4G", "--plan"]
    out = CliRunner().invoke(cli, [*args, "--max-context", "256"])
    assert out.exit_code == 0, out.output
    assert "card 0 budget (cpu)" in out.output and "card 1 budget (cpu)" in out.output
    assert "embedding" in out.output and "head" in out.output
    got = CliRunner().invoke(cli, [*args, "--max-context", "256", "--json"])
    cards = json.loads(got.output)["cards"]
    assert [c["budget"] for c in cards] == [3 << 30, 3 << 30]
    assert sorted(i for c in cards for i in c["layers"]) == list(range(Manifest.open(converted).args.n_layers))
    refused = CliRunner().invoke(cli, ["run", str(converted), "--devices", "cpu", "--plan"])
    assert refused.exit_code != 0 and "a split takes 2 or more cards" in refused.output


@pytest.mark.parametrize(("one", "two"), [("3090", "2x3090"), ("24g", "2x4090")])
def test_the_projection_plans_the_whole_v3_split_on_two_cards(one, two):
    from dsfp4.projection.machines import MACHINES
    from dsfp4.projection.whole_model import full_plan

    _, single = full_plan("v3", MACHINES[one])
    _, split = full_plan("v3", MACHINES[two])
    assert len(split.cards) == 2 and not single.cards
    assert sorted(i for c in split.cards for i in c.layers) == list(range(61))
    # the same RAM; the second card's budget goes to slots once its layers' backbone is placed
    assert split.ram_slots == single.ram_slots and split.gpu_slots > 2 * single.gpu_slots
    assert all(c.backbone + c.kv_cache + c.workspace + c.gpu_slots * split.record <= c.budget for c in split.cards)
