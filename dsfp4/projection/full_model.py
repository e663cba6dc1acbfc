"""The whole model beside the small bench model: the share of DeepSeek-V3's expert records that the planner puts
on the device and in RAM under each preset, so that a bench model of a few layers can run at the full model's
share of the budgets (docs/BENCHMARKS.md: "the full model's share")."""

from __future__ import annotations

import torch

from dsfp4.projection.planned import planned_manifest
from dsfp4.runtime.plan.budget import PRESETS, Budgets
from dsfp4.runtime.plan.planner import make_plan
from dsfp4.synthetic.bench_model import model_args

# the presets describe GPU machines: plan as on one, wherever this runs
PLAN_DEVICE = torch.device("cuda")


def preset_shares() -> dict[str, tuple[float, float, str]]:
    """Share of all experts the planner puts on the device and in RAM for the full V3 under each preset
    (16g with the NVFP4 backbone, which a 16 GB card needs; 24g with the FP8 release backbone)."""
    out = {}
    for preset, backbone in (("16g", "nvfp4"), ("24g", "fp8_e4m3_b128")):
        m = planned_manifest(model_args(61, 3)[1], backbone)
        p = PRESETS[preset]
        plan = make_plan(m, PLAN_DEVICE, torch.bfloat16, Budgets(p.gpu, p.cpu, preset), 4096, 512, 4)
        out[preset] = (plan.gpu_slots / plan.total_records, plan.ram_slots / plan.total_records, plan.table())
    return out
