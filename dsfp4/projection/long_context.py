"""Decode at a long context, projected from measured parts: the whole model planned for that context (its latent
caches in pinned RAM where the device cannot hold them beside the backbone: runtime/plan/host_backbone.py), its
decode simulated as whole_model.py simulates it, plus what a step at that position adds: its caches' rows read, those
in RAM over the link the expert copies take (an upper bound: added after them, not beside them), those on the device
at the decode's measured share of the GPU's memory bandwidth."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsfp4.projection.first_token import ANSWER_TOKENS
from dsfp4.projection.machines import MACHINES
from dsfp4.projection.whole_model import MAX_CONTEXT, columns, machine_run
from dsfp4.runtime.plan.planner import layer_cache_bytes

# positions a decode step sits at
CONTEXTS = (1024, 32768)
# the store's variant: the default policy, the router's guesses at 90% recall (whole_model.VARIANTS)
POLICY, RECALL = "hot", 0.9


@dataclass(frozen=True)
class ContextDecode:
    machine: str
    context: int
    tok_s: float
    # seconds a step spends on its caches' rows (those in RAM, those on the device)
    cache_s: float
    # bytes of latent rows the step reads from RAM, and of backbone the plan keeps there
    ram_cache_bytes: float
    host_backbone: int

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def context_decodes(
    family: str, ids: np.ndarray, machines: list[str], eff: float, contexts: tuple[int, ...] = CONTEXTS
) -> list[ContextDecode]:
    """Decode of the whole model on each machine at each context (`eff`: the decode's share of memory bandwidth)."""
    rows = []
    for name in machines:
        machine = MACHINES[name]
        for c in contexts:
            r = machine_run(family, name, ids, eff, max_context=max(MAX_CONTEXT, c + ANSWER_TOKENS))
            m, plan = r.m, r.plan
            step = 1 / r.decode(POLICY, RECALL, True).tok_s
            a = m.args
            row = {i: layer_cache_bytes(a, i, 1, 2)[0] for i in range(a.n_layers)}  # bytes a position, bf16
            in_ram = c * sum(row[i] for i in plan.on_host.caches)
            on_device = c * sum(row.values()) - in_ram
            cache_s = in_ram / machine.links.pcie + on_device / (machine.hbm * machine.decode_efficiency(eff))
            rows.append(ContextDecode(name, c, 1 / (step + cache_s), cache_s, in_ram, plan.host_backbone))
    return rows


def context_table(rows: list[ContextDecode]) -> str:
    head = ("machine", "context", "tok/s", "of the shortest", "cache ms/step", "cache in RAM GB", "backbone in RAM GB")
    lines = [head]
    first = {}
    for r in rows:
        first.setdefault(r.machine, r.tok_s)
        lines.append(
            (
                r.machine,
                str(r.context),
                f"{r.tok_s:.2f}",
                f"{r.tok_s / first[r.machine]:.0%}",
                f"{1000 * r.cache_s:.1f}",
                f"{r.ram_cache_bytes / 1e9:.2f}",
                f"{r.host_backbone / 1e9:.2f}",
            )
        )
    return columns(lines, left=1)
