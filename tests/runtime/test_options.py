"""RunOptions' compute dtype: --dtype's name as torch's dtype, auto by the device (the module imports torch only here,
for the command line's help reads it)."""

from __future__ import annotations

import pytest
import torch

from dsfp4.errors import ConfigError
from dsfp4.runtime.options import DTYPES, RunOptions


@pytest.mark.parametrize(
    ("dtype", "device", "want"),
    [
        ("auto", "cpu", torch.float32),
        ("auto", "cuda", torch.bfloat16),
        ("bf16", "cpu", torch.bfloat16),
        ("fp32", "cuda", torch.float32),
    ],
)
def test_the_dtype_flag_names_a_torch_dtype(dtype, device, want):
    assert RunOptions(dtype=dtype).torch_dtype(torch.device(device)) is want


def test_an_unknown_dtype_is_refused_naming_the_choices():
    assert set(DTYPES) == {"bf16", "fp32"}
    with pytest.raises(ConfigError, match="--dtype fp16: choose auto, bf16, fp32"):
        RunOptions(dtype="fp16")
