"""`convert --backbone auto`: the backbone format for the machine the model will run on.

The ways, most exact first (docs/BENCHMARKS.md, issue 33's entry: measured on the trained small DeepSeek, projected
for the whole V3):
  fp8                 exact to the release where it ships FP8; on a 16 GB card DeepSeek-V3's does not fit, and the
                      part that does not stays in RAM, read over PCIe every token (a slower projected decode)
  fp4:wo,wq_b,shared  the attention's output and query up-projections and the shared experts in NVFP4: on 16 GB the
                      best projected decode (about all-FP4's) at a KL no worse than the NVFP4 experts' own, where
                      all-FP4 costs more
`auto` takes the first way whose plan keeps the whole backbone on the device under the machine's budgets, else the
last (the least of it in RAM). The device budget alone decides: the choice never turns on the RAM budget (the plan
is made with all the RAM it asks for). With no GPU to size for and no --preset, fp8. On this machine's card the
plan reserves what its kernel paths need (where FP8 runs by the reference, a dense copy of the largest matrix).
"""

from __future__ import annotations

import torch

from dsfp4.errors import ConfigError
from dsfp4.layout.model_args import ModelArgs
from dsfp4.projection.planned import planned_manifest
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.plan.budget import Budgets, GiB
from dsfp4.runtime.plan.planner import make_plan

AUTO = "auto"
WAYS = ("fp8", "fp4:wo,wq_b,shared")
# the run a plan is sized for: `dsfp4 run`'s defaults
RUN_DEFAULTS = RunOptions()
# the choice is the device's: RAM never decides it
UNBOUNDED_RAM = 1 << 50


def run_shape() -> tuple[int, int, int]:
    """(max context, prefill chunk, I/O threads) of RUN_DEFAULTS, as make_plan takes them."""
    return RUN_DEFAULTS.max_context, RUN_DEFAULTS.prefill_chunk, RUN_DEFAULTS.io_threads


def choose_backbone(
    args: ModelArgs,
    budgets: Budgets,
    expert_format: str,
    process: int | None = None,
    kernels: bool = True,
    fp8_kernels: bool = True,
) -> tuple[str, str]:
    """(spec, why) for a model of shape `args` run on a CUDA device under `budgets`, whose kernels run or not, and FP8
    kernels with them (kernels/kernel_paths.py: where they do not, the plan holds the reference's dense copies)."""
    device = torch.device("cuda")
    room = Budgets(budgets.gpu, UNBOUNDED_RAM, budgets.source)
    for spec in WAYS:
        m = planned_manifest(args, spec, expert_format)
        try:
            plan = make_plan(
                m, device, torch.bfloat16, room, *run_shape(), process=process, fp8_kernels=fp8_kernels, kernels=kernels
            )
        except ConfigError:
            # the device cannot hold even what must stay on it
            continue
        if plan.host_backbone == 0:
            return spec, f"the whole backbone fits {budgets.source} in {spec}"
    return WAYS[-1], f"no backbone fits {budgets.source} whole: {WAYS[-1]} leaves the least of it in RAM"


def card_budget(device: torch.device) -> Budgets:
    """The device budget `auto` sizes for on this machine: the card's total memory less the margin the run's default
    budget leaves (budget.py), so that the choice does not move with what else holds the card when it is made."""
    total = torch.cuda.get_device_properties(device).total_memory
    name = torch.cuda.get_device_name(device)
    return Budgets(total - max(total // 20, GiB // 2), UNBOUNDED_RAM, f"this machine's {name}")
