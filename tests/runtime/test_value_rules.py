"""One rule for a sampling or lever value at every door: a flag, a batch line, RunOptions and Engine.generate refuse
NaN, infinities and seeds generators cannot take, in one line naming the flag, before a model loads."""

from __future__ import annotations

import dataclasses
import math

import pytest

from dsfp4.errors import ConfigError
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.generate.value_rules import SEED_LIMIT
from dsfp4.runtime.options import RunOptions
from dsfp4.tools.batch_file import parse_line
from tests.fixtures.cli import run_cli

FLOATS = sorted(f.name for f in dataclasses.fields(RunOptions) if f.init and "float" in str(f.type))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", FLOATS)
def test_every_float_option_refuses_a_number_that_is_not_finite(name, value):
    with pytest.raises(ConfigError, match=f"option {name}: expected a finite number.*--{name.replace('_', '-')}"):
        RunOptions(**{name: value})


@pytest.mark.parametrize("seed", [SEED_LIMIT, 99999999999999999999999, -1])
def test_a_seed_generators_cannot_take_is_refused(seed):
    with pytest.raises(ConfigError, match=f"--seed {seed}: give an integer from 0 to {SEED_LIMIT - 1}"):
        RunOptions(seed=seed)
    RunOptions(seed=SEED_LIMIT - 1)


@pytest.mark.parametrize("line", ['{"prompt": "hi", "temperature": NaN}', '{"prompt": "hi", "seed": 1e400}'])
def test_a_batch_line_with_nan_is_refused_before_the_load(line):
    with pytest.raises(ConfigError, match="in.jsonl:3: option (temperature|seed)"):
        parse_line(line, "in.jsonl:3", RunOptions())


def test_a_huge_seed_on_a_batch_line_is_refused_before_the_load():
    with pytest.raises(ConfigError, match="in.jsonl:1: --seed 99999999999999999999999"):
        parse_line('{"prompt": "hi", "seed": 99999999999999999999999}', "in.jsonl:1", RunOptions())


@pytest.mark.parametrize(
    "flags",
    [
        ("--temperature", "nan"),
        ("--temperature", "inf"),
        ("--top-p", "nan"),
        ("--min-p", "nan"),
        ("--cache-aware", "nan"),
        ("--cache-aware", "inf"),
        ("--seed", "99999999999999999999999"),
    ],
)
def test_run_flags_refuse_nan_infinities_and_huge_seeds(converted, flags):
    r = run_cli("run", converted, "--prompt", "hi", "--device", "cpu", *flags)
    assert r.exit_code == 2 and f"Invalid value for '{flags[0]}'" in r.stderr and "Traceback" not in r.stderr


def test_profile_hot_refuses_a_nan_hot_share_before_profiling(converted):
    r = run_cli("profile-hot", converted, "--repack", "--cold-bits", "2", "--hot-share", "nan")
    assert r.exit_code == 2 and "'--hot-share': 'nan' is not a finite number" in r.stderr and "budgets" not in r.stderr


def test_engine_generate_refuses_a_nan_temperature_with_a_config_error(converted):
    nan = pytest.raises(ConfigError, match="option temperature: expected a finite number, found nan")
    with Engine(converted, device="cpu", max_context=64) as engine, nan:
        engine.generate("hi", temperature=float("nan"), max_tokens=2)
