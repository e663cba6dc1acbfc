"""A repack by a cold recipe on the tests' tiny model: each layer's cold records at its own bits and size, a run and an
eval of it give the logits of the model whose records are what narrowing then widening each matrix predicts, resident
or streamed through narrow RAM slots of the largest cold size; bad recipes and flags are refused in one line."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dsfp4.cli.main import cli
from dsfp4.errors import ConfigError
from dsfp4.layout.hot_profile import HOT_NAME, HotProfile
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.recipe import ColdRecipe
from dsfp4.layout.record import record_sha256
from dsfp4.layout.repack import Cold, cold_experts, repack
from dsfp4.layout.verify import verify
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.models.load import plan_run
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.plan.budget import Budgets
from dsfp4.runtime.plan.planner import make_plan

CPU = torch.device("cpu")
RECIPE = "gate=2,up=2,down=3;2:down=4"
PROMPT = "Which matrices are narrow?"
# fp32 rounding of a different order of the experts' sums (measured: 5e-7, the exact model's streamed run alike)
STREAMED_ATOL = 1e-5


def _predicted(model: Path, out: Path, recipe: ColdRecipe, share: float) -> Path:
    """A copy of `model` (not yet repacked) whose records that the repack will narrow are replaced, in place and at full
    size, by what narrowing each matrix at its recipe's bits and widening it back gives: the model the repack's
    logits must equal."""
    shutil.copytree(model, out)
    (out / HOT_NAME).unlink()
    m, profile = Manifest.read(out), HotProfile.read(model / HOT_NAME)
    experts = dict(m.experts)
    for layer in profile.counts:
        ef, sha = m.experts[layer], list(m.experts[layer].sha256)
        cold = m.record.cold_of(recipe.of(layer))
        with open(out / ef.file, "r+b") as f:
            for e in cold_experts(profile.order(layer), share):
                f.seek(ef.offsets[e])
                raw = torch.frombuffer(bytearray(f.read(m.record.nbytes)), dtype=torch.uint8)
                wide = cold.widen(m.record.narrow(raw, cold.code_bits)).numpy()
                f.seek(ef.offsets[e])
                f.write(wide.tobytes())
                sha[e] = record_sha256(wide)
        experts[layer] = dataclasses.replace(ef, sha256=tuple(sha))
    dataclasses.replace(m, experts=experts).write(out)
    return out


def _logits(model: Path, slots: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Logits of a fixed text and the greedy tokens of PROMPT; slots (device, RAM, of them narrow) or resident."""
    m = Manifest.read(model)
    options = RunOptions(device="cpu", max_context=64, io_threads=1, zero_copy=False)
    plan = plan_run(m, CPU, torch.float32, 64, options, False)
    if slots:
        g, r, narrow = slots
        plan = dataclasses.replace(plan, gpu_slots=g, ram_slots=r, staging=1, cold_slots=narrow)
        plan = dataclasses.replace(plan, cold_record=m.cold_nbytes() if narrow else 0)
    with Engine(model, options, plan=plan) as engine:
        ids = engine.tokenizer.encode("the narrow matrices of a cold record widen back", special=False)
        return engine.logits(ids), engine.generate(PROMPT, max_tokens=8, temperature=0).token_ids


@pytest.mark.slow
def test_a_recipe_repack_runs_as_narrowing_then_widening_each_matrix_predicts(model, tmp_path):
    recipe = ColdRecipe.parse(RECIPE)
    predicted = _logits(_predicted(model, tmp_path / "predicted", recipe, 0.5))
    r = repack(model, HotProfile.read(model / HOT_NAME), cold=Cold(recipe, 0.5))
    assert (r.rewritten, r.narrowed) == (2, 8)
    m = Manifest.read(model)
    assert m.version == 2 and m.cold_recipe() == recipe
    one, two = m.experts[1].cold_record, m.experts[2].cold_record
    assert (one.code_bits, two.code_bits) == ((2, 2, 3), (2, 2, 4)) and one.nbytes < two.nbytes < m.record.nbytes
    assert m.cold_nbytes() == two.nbytes and m.experts[3].cold == ()
    verify(model)
    assert repack(model, HotProfile.read(model / HOT_NAME), cold=Cold(recipe, 0.5)).rewritten == 0  # done already
    with pytest.raises(ConfigError, match="2/2/3 bits \\(gate/up/down\\), which cannot be undone"):
        repack(model, HotProfile.read(model / HOT_NAME), cold=Cold(ColdRecipe.parse("all=2"), 0.5))
    logits, tokens = _logits(model)
    assert torch.equal(logits, predicted[0]) and tokens == predicted[1]
    for slots in ((2, 3, 0), (2, 8, 4)):  # record-sized RAM slots; 4 narrow ones among 8, of the larger cold size
        streamed = _logits(model, slots)
        # a streamed step adds its experts as they arrive: rounding apart (the exact model's too), the same logits
        assert torch.allclose(streamed[0], logits, rtol=0, atol=STREAMED_ATOL) and streamed[1] == tokens, slots


@pytest.mark.slow
def test_the_planner_sizes_narrow_slots_for_the_largest_cold_record_of_a_recipe(model):
    repack(model, HotProfile.read(model / HOT_NAME), cold=Cold(ColdRecipe.parse(RECIPE), 0.5))
    m = Manifest.read(model)
    n, c = m.record.nbytes, m.cold_nbytes()
    fixed = make_plan(m, CPU, torch.float32, Budgets(1 << 40, 8 * n + 6 * c, "test"), 64, 64, 1, process=0)
    fixed = fixed.backbone + fixed.kv_cache + fixed.workspace + fixed.host_base
    plan = make_plan(m, CPU, torch.float32, Budgets(fixed + 2 * n, 8 * n + 6 * c, "test"), 64, 64, 1, process=0)
    assert plan.cold_record == c and (plan.ram_slots, plan.cold_slots) == (14, 6)


def test_profile_hot_takes_a_recipe_and_refuses_bad_ones_naming_the_flag(model):
    runner = CliRunner()

    def run(*flags: str):
        return runner.invoke(cli, ["profile-hot", str(model), "--no-measure", *flags])

    r = run("--repack", "--cold-recipe", "gate=2,up=9,down=3", "--hot-share", "0.5")
    assert r.exit_code == 2 and "Invalid value for '--cold-recipe'" in r.output and "up takes 2, 3 or 4" in r.output
    assert "e.g. --cold-recipe gate=2,up=2,down=3" in r.output
    r = run("--repack", "--cold-recipe", "all=2", "--cold-bits", "2")
    assert r.exit_code == 2 and "not both" in r.output
    r = run("--cold-recipe", "all=2")
    assert r.exit_code == 2 and "--cold-recipe narrows records while repacking; add --repack" in r.output
    r = run("--repack", "--cold-recipe", "all=2;5:down=3", "--hot-share", "0.5")
    assert r.exit_code == 1 and "--cold-recipe overrides block 5" in r.output and "name only 1, 2" in r.output
    assert Manifest.read(model).cold_layouts() == {}  # refused before any layer was written
    env = {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    r = runner.invoke(
        cli,
        ["profile-hot", str(model), "--no-measure", "--repack", "--cold-recipe", RECIPE, "--hot-share", "0.5"],
        env=env,
    )
    assert r.exit_code == 0, r.output
    assert f"8 records narrowed by the cold recipe {RECIPE} (hot share 0.50)" in r.output
    assert Manifest.read(model).cold_recipe() == ColdRecipe.parse(RECIPE)
