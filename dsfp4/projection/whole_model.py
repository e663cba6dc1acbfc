"""The whole model projected from the small one: a DeepSeek model that is not on this machine, decoded through the
store's own pools and policies (simulate.py) under a routing trace, at the budgets the planner gives the whole model
on a user's machine, with compute scaled from what the bench model measured.

- Budgets: the planner's plan of the whole model (its manifest without files: planned.py) under the machine's
  budgets (machines.py); V3 on a 16 GB card takes the NVFP4 backbone it needs.
- Compute: the bench model's resident decode step reads its bytes at a measured fraction of the GPU's memory
  bandwidth (`efficiency`); the whole model's step reads its own bytes (per MoE layer: attention and router,
  then routed and shared experts; per token: dense layers and the head) at that fraction of the user's GPU's.
- Routing: the trace's layers spread over the model's MoE layers as --routing spreads them; the tiers start warm
  from a profile of the trace's first half (as profile-hot measures one on calibration text) and the second half
  is decoded (so the profile never saw the tokens it is scored on).
- Links: the machine's SSD and pinned PCIe bandwidth, each at its full rate.
- Time to first token: first_token.py.
- The process: machines.py's USER_PROCESS, what `dsfp4 run` holds when it plans (not what the projecting process
  holds).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dsfp4.errors import ConfigError
from dsfp4.layout.formats import FORMATS, stored_nbytes
from dsfp4.layout.manifest import Manifest, TensorEntry
from dsfp4.layout.model_args import ModelArgs
from dsfp4.layout.recipe import EXACT, ColdRecipe
from dsfp4.layout.repack import cold_experts
from dsfp4.projection.backbone_choice import choose_backbone, run_shape
from dsfp4.projection.machines import MACHINES, USER_PROCESS, Machine
from dsfp4.projection.planned import planned_manifest
from dsfp4.projection.replay import belady
from dsfp4.projection.simulate import (
    ColdRecords,
    HostStream,
    Projection,
    StepCosts,
    SwapModel,
    simulate,
)
from dsfp4.projection.simulate_prefill import simulate_prefill
from dsfp4.projection.top_k import keep
from dsfp4.runtime.models.load import with_experts_per_token
from dsfp4.runtime.plan.device_split import make_split_plan
from dsfp4.runtime.plan.host_backbone import EMBED, tensor_bytes
from dsfp4.runtime.plan.planner import ONE_ROW, ROUTER_SUFFIXES, Plan, expert_layers, make_plan, with_narrow_slots
from dsfp4.synthetic.bench_model import model_args
from dsfp4.synthetic.releases import RELEASES

# a layer-wise pass copies a block's hidden states to the device and back around its attention and its feed-forward
# (runtime/generate/layer_pass.py)
HIDDEN_CROSSINGS = 4

# the machines are GPU machines: plan as on one, wherever this runs
PLAN_DEVICE = torch.device("cuda")
# the run the plan is made for: `dsfp4 run`'s defaults
MAX_CONTEXT, PREFILL_CHUNK, IO_THREADS = run_shape()
# per MoE layer whose experts stream: the host reads the routing and queues the loads
HOST_S = 40e-6


def full_args(family: str) -> ModelArgs:
    """The whole released model's shape (synthetic/releases.py), as the bench model's writer gives it."""
    release = RELEASES[family]
    return model_args(release.whole_layers, release.whole_dense, family=family)[1]


def full_plan(
    family: str,
    machine: Machine,
    backbone: str | None = None,
    max_context: int = MAX_CONTEXT,
    experts_per_token: int = 0,
) -> tuple[Manifest, Plan]:
    """The whole model's manifest and plan on the machine for `max_context` (run's default, or what a long prompt
    needs): with the backbone `convert --backbone auto` gives it there (backbone_choice.py), or `backbone` (a
    --backbone spec, convert/backbone.py); a ConfigError when even with the backbone in RAM it does not fit.
    experts_per_token: the shape `run --experts-per-token` gives it (0: the model's own); the backbone stays the
    one its conversion chose."""
    args = full_args(family)
    expert_format = args.family_spec.expert_format
    spec = backbone or choose_backbone(args, machine.budgets, expert_format, USER_PROCESS)[0]
    m = planned_manifest(args, spec, expert_format)
    m = with_experts_per_token(m, experts_per_token, Path(f"the whole {family}"))
    try:
        budgets, b = machine.budgets, (max_context, PREFILL_CHUNK, IO_THREADS)
        if machine.cards > 1:
            # the layers split across the cards: each card's slots serve its layers (simulated as one pool)
            cards = [PLAN_DEVICE] * machine.cards
            return m, make_split_plan(m, cards, torch.bfloat16, budgets, *b, process=USER_PROCESS, kernels=True)
        return m, make_plan(
            m, PLAN_DEVICE, torch.bfloat16, budgets, *b, process=USER_PROCESS, fp8_kernels=True, kernels=True
        )
    except ConfigError as e:
        raise ConfigError(f"{family}: the planner fits no backbone {spec} in {machine.about}") from e


def _per_token(m: Manifest, size: Callable[[str, TensorEntry], float], record: float) -> tuple[float, float, float]:
    """A token's `size` of the backbone's tensors, split (per MoE layer before its router: attention and router; per
    MoE layer after: routed experts, `record` each, and shared experts; per token: the rest)."""
    a = m.args
    moe = [b for b in range(a.n_layers) if b in m.experts]
    attn = experts = other = 0.0
    for name, t in m.tensors.items():
        if name.startswith(a.mtp_prefixes):
            continue
        n = size(name, t)
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        if layer not in moe:
            other += n
        elif ".ffn." in name and not name.endswith(ROUTER_SUFFIXES):
            experts += n
        else:
            attn += n
    experts += len(moe) * a.n_activated_experts * record
    return attn / len(moe), experts / len(moe), other


def step_bytes(m: Manifest) -> tuple[float, float, float]:
    """Bytes a decode token reads (as planner.token_bytes counts them), split as _per_token splits them."""

    def size(name: str, t: TensorEntry) -> float:
        n = stored_nbytes(FORMATS[t.format], tuple(t.shape))
        if name.endswith(ONE_ROW):
            return n // t.shape[0] + (n if name == "embed.weight" and m.args.tie_word_embeddings else 0)
        return n * 32 // FORMATS[t.format].bits if name.endswith(ROUTER_SUFFIXES) else n

    return _per_token(m, size, sum(p.nbytes for p in m.record.parts) if m.record else 0)


def host_stream(m: Manifest, plan: Plan, elt: int = 2) -> HostStream:
    """The plan's backbone in pinned RAM as the simulation reads it each step (a streamed MoE layer's attention and
    router, its shared experts; dense layers and the embedding's row per token), tensors as loaded in `elt`-byte
    plain dtype; and a layer-wise pass's hidden states, HIDDEN_CROSSINGS copies a token and block."""

    def size(name: str, t: TensorEntry) -> float:
        if not plan.on_host.holds(name):
            return 0.0
        n = tensor_bytes(name, t, elt)
        return n / t.shape[0] if name == EMBED else n

    # per MoE layer: averaged over all of them
    attn, experts, other = _per_token(m, size, 0.0)
    moe = [b for b in range(m.args.n_layers) if b in m.experts]
    streamed = frozenset(j for j, b in enumerate(moe) if b in plan.on_host.layers)
    per_streamed = len(moe) / max(len(streamed), 1)
    a = m.args
    hidden = HIDDEN_CROSSINGS * max(1, a.hc_mult) * a.dim * elt * a.n_layers / max(len(moe), 1)
    return HostStream(streamed, attn * per_streamed, experts * per_streamed, other, hidden)


def step_flops(m: Manifest) -> tuple[float, float, float]:
    """FLOPs of a prompt token's matrix products (2 per weight; tables it reads one row of cost none), split as
    _per_token splits them."""

    def size(name: str, t: TensorEntry) -> float:
        return 0.0 if name.endswith(ONE_ROW) else 2.0 * math.prod(t.shape)

    a = m.args
    return _per_token(m, size, 2.0 * 3 * a.dim * a.moe_inter_dim)


def n_moe_layers(m: Manifest) -> int:
    """MoE layers of the main model (the MTP block's left out)."""
    return len(expert_layers(m))


def decode_costs(m: Manifest, hbm: float, efficiency: float) -> StepCosts:
    """The step's compute when it reads its bytes at `efficiency` of `hbm` bytes/s."""
    attn, experts, other = step_bytes(m)
    rate = hbm * efficiency
    return StepCosts(attn / rate, experts / rate, other / rate, HOST_S)


def efficiency(m: Manifest, seconds_per_token: float, hbm: float) -> float:
    """The share of the GPU's memory bandwidth a measured resident decode step read its bytes at."""
    attn, experts, other = step_bytes(m)
    return (n_moe_layers(m) * (attn + experts) + other) / seconds_per_token / hbm


def spread(ids: np.ndarray, n_moe: int) -> np.ndarray:
    """The trace's layers for a model of n_moe MoE layers: layer j takes trace layer floor(j L / n_moe)."""
    return ids[:, [j * ids.shape[1] // n_moe for j in range(n_moe)]]


def warm_order(profile: np.ndarray, n_experts: int) -> list[tuple[int, int]]:
    """Every (layer, expert) hottest first by the use counts of `profile` [tokens, layers, K]."""
    counts = np.stack([np.bincount(profile[:, i].ravel(), minlength=n_experts) for i in range(profile.shape[1])])
    keys = [(i, e) for i in range(counts.shape[0]) for e in range(n_experts)]
    return sorted(keys, key=lambda k: -counts[k])


def cold_records(warm: list[tuple[int, int]], n_experts: int, hot_share: float, nbytes: int) -> ColdRecords:
    """The records a cold repack narrows (layout/repack.py cold_experts) when its profile ranks them as `warm` does
    (every (layer, expert) of the n_experts of each layer, hottest first)."""
    order: dict[int, list[int]] = {}
    for layer, e in warm:
        order.setdefault(layer, []).append(e)
    assert all(len(experts) == n_experts for experts in order.values()), "a profile ranks every expert of a layer"
    keys = {(layer, e) for layer, experts in order.items() for e in cold_experts(experts, hot_share)}
    return ColdRecords(frozenset(keys), nbytes)


def halves(ids: np.ndarray, n_experts: int) -> tuple[list[tuple[int, int]], np.ndarray]:
    """A trace [N, L, K] -> (the warm start a profile of its first half gives, its second half: the decode scored)."""
    half = len(ids) // 2
    return warm_order(ids[:half], n_experts), ids[half:]


@dataclass(frozen=True)
class MachineRun:
    """The whole model planned on one machine, its compute, and the trace's two halves (halves): what each
    variant of the store decodes."""

    machine: Machine
    m: Manifest
    plan: Plan
    costs: StepCosts
    warm: list[tuple[int, int]]
    run: np.ndarray
    # the plan's backbone read from RAM each step
    host: HostStream

    @property
    def warmup(self) -> int:
        """The run's first tokens decoded but not scored: the pools settling from the warm start."""
        return min(32, len(self.run) // 4)

    def decode(
        self,
        policy: str,
        recall: float | None,
        prefetch_reads: bool,
        skippable: np.ndarray | None = None,
        swap: SwapModel | None = None,
        cold_bits: ColdRecipe | int | None = None,
        cpu: float = 0.0,
        adaptive: bool = False,
        hot_share: float | None = None,
    ) -> Projection:
        """The trace's second half decoded through the plan's pools, warm-started from the first (halves);
        skippable and swap: the lossy levers (simulate); cold_bits (a width, or a recipe): the records outside each
        layer's hottest `hot_share` (default: as much as the plan's device and RAM slots hold, `profile-hot
        --cold-bits`' default) in cold codes, the RAM cache split as the planner splits it (narrow_slots); cpu: the
        CPU lane's kernel rate, bytes/s (0: no lane), at the share `--cpu-experts auto` would take; adaptive: the
        threshold as `--expert-threshold auto` applies it, at this machine's SSD / PCIe ratio."""
        links = dataclasses.replace(self.machine.links, cpu=cpu)
        plan, cold = self.plan, None
        if cold_bits:
            plan, cold = self.narrowed(cold_bits, hot_share)
        return simulate(
            self.run,
            plan.gpu_slots,
            plan.ram_slots,
            self.m.record.nbytes,
            links,
            self.costs,
            policy,
            recall,
            self.m.args.n_routed_experts,
            warmup=self.warmup,
            warm=self.warm,
            prefetch_reads=prefetch_reads,
            skippable=skippable,
            swap=swap,
            host=self.host,
            cold=cold,
            host_share=cpu / (cpu + links.pcie) if cpu else 0.0,
            hide_ratio=links.ssd / links.pcie if adaptive else None,
        )

    def narrowed(self, recipe: ColdRecipe | int, hot_share: float | None = None) -> tuple[Plan, ColdRecords]:
        """The records a `profile-hot --repack --cold-recipe R (or --cold-bits N) [--hot-share S]` at this plan's
        budgets narrows, each layer's at its recipe's size, and the plan with the RAM cache split for them (the
        planner's narrow_slots on the same bytes, narrow slots of the largest)."""
        recipe = ColdRecipe.uniform(recipe) if isinstance(recipe, int) else recipe
        p, m = self.plan, self.m
        # the trace's layer j is the run's j-th MoE block, which the recipe's overrides name
        sizes = {
            j: m.record.cold_of(recipe.of(b)).nbytes for j, b in enumerate(expert_layers(m)) if recipe.of(b) != EXACT
        }
        share = p.held_share if hot_share is None else hot_share
        keys = frozenset(k for k in cold_records(self.warm, m.args.n_routed_experts, share, 0).keys if k[0] in sizes)
        nbytes = max(sizes.values())
        plan = with_narrow_slots(p, nbytes, len(keys), m.args.n_activated_experts)
        return plan, ColdRecords(keys, nbytes, plan.cold_slots, tuple(sorted(sizes.items())))

    def routed_bits(self, recipe: ColdRecipe | int | None, hot_share: float | None = None) -> float:
        """Bits per routed weight as stored (scales included) over every record of the run's MoE layers, those that
        `recipe` narrows (narrowed) at their size."""
        rec, n = self.m.record, self.m.args.n_routed_experts
        layers = len(expert_layers(self.m))
        total = layers * n * rec.nbytes
        if recipe is not None:
            cold = self.narrowed(recipe, hot_share)[1]
            total -= sum(rec.nbytes - cold.size(k) for k in cold.keys)
        return 8 * total / (layers * n * 3 * rec.dim * rec.inter_dim)

    def decode_batch(self, b: int, policy: str = "hot") -> Projection:
        """b sequences decoding together (runtime/generate/batch.py), each through a stretch of the trace's second
        half of its own, a step's b rows brought in as one chunk (simulate_prefill: their union of experts per layer,
        in waves when the device slots run short; no prefetch) -> totals (`tokens`, `seconds`, bytes). A step costs
        one token's compute: decode kernels are bound by the bytes they read, which the batch's tokens share (an
        upper bound; a step of 16 cost more on a host-bound model: docs/BENCHMARKS.md, run 37)."""
        n, layers, k = self.run.shape
        stretch = n // b
        rows = self.run[: stretch * b].reshape(b, stretch, layers, k).swapaxes(0, 1).reshape(-1, layers, k)
        c = self.costs
        # simulate_prefill multiplies
        per_step = StepCosts(c.attn_s / b, c.experts_s / b, c.other_s / b, c.host_s)
        return simulate_prefill(
            rows,
            self.plan.gpu_slots,
            self.plan.ram_slots,
            self.m.record.nbytes,
            self.machine.links,
            per_step,
            b,
            policy,
            warm=self.warm,
            host=self.host,
            decode_steps=True,
        )


def machine_run(
    family: str,
    name: str,
    ids: np.ndarray,
    eff: float,
    backbone: str | None = None,
    max_context: int = MAX_CONTEXT,
    experts_per_token: int = 0,
    weights: np.ndarray | None = None,
) -> MachineRun:
    """`family` planned on machine `name` for `max_context` (full_plan), `ids` [N, L, K] spread over its MoE layers
    and halved, its decode compute at `eff` (the native path's share) of the machine's memory bandwidth;
    experts_per_token k: each token keeps its k heaviest choices (top_k.keep, by the trace's `weights` [N, L, K] where
    it has them; 0: all), the model planned for k."""
    machine = MACHINES[name]
    m, plan = full_plan(family, machine, backbone, max_context, experts_per_token=experts_per_token)
    ids = keep(ids, experts_per_token, weights)
    warm, run = halves(spread(ids, n_moe_layers(m)), m.args.n_routed_experts)
    costs = decode_costs(m, machine.hbm, machine.decode_efficiency(eff))
    return MachineRun(machine, m, plan, costs, warm, run, host_stream(m, plan))


@dataclass(frozen=True)
class Row:
    machine: str
    policy: str
    recall: float | None
    prefetch_reads: bool
    projection: Projection
    belady_not_ssd: float
    gpu_share: float
    ram_share: float
    record_bytes: int

    def to_dict(self) -> dict:
        return {
            "machine": self.machine,
            "policy": self.policy,
            "recall": self.recall,
            "prefetch_reads": self.prefetch_reads,
            "belady_not_ssd": self.belady_not_ssd,
            "gpu_share": self.gpu_share,
            "ram_share": self.ram_share,
            **self.projection.to_dict(),
        }


# (policy, prefetch recall or None, prefetch may read from the SSD)
VARIANTS = (
    ("mix", None, True),
    ("mix", 0.9, True),
    ("hot", None, True),
    ("hot", 0.9, True),
    ("hot", 0.9, False),
    ("hot", 1.0, True),
)


def project(
    family: str,
    ids: np.ndarray,
    machines: list[str],
    eff: float,
    variants: tuple = VARIANTS,
    backbone: str | None = None,
) -> list[Row]:
    """The whole model of `family` on each machine under each variant of the store (`backbone`: full_plan's)."""
    rows = []
    for name in machines:
        r = machine_run(family, name, ids, eff, backbone)
        plan, n = r.plan, r.plan.total_records
        # the same for every variant
        opt = 1.0 - belady(r.run, plan.gpu_slots, plan.ram_slots).ssd_rate
        for policy, recall, reads in variants:
            p = r.decode(policy, recall, reads)
            rows.append(
                Row(name, policy, recall, reads, p, opt, plan.gpu_slots / n, plan.ram_slots / n, r.m.record.nbytes)
            )
    return rows


def table(rows: list[Row]) -> str:
    head = (
        "machine",
        "policy",
        "prefetch",
        "tok/s",
        "ms/token",
        "compute",
        "waiting",
        "SSD GB",
        "PCIe GB",
        "device %",
        "RAM %",
        "SSD %",
        "Belady SSD %",
    )
    lines = [head]
    for r in rows:
        p = r.projection
        pre = "none" if r.recall is None else f"{r.recall:.2f}" + ("" if r.prefetch_reads else " RAM")
        # reads per use, wasted guesses included
        ssd = p.ssd_bytes / r.record_bytes / p.uses if p.uses else 0.0
        lines.append(
            (
                r.machine,
                r.policy,
                pre,
                f"{p.tok_s:.2f}",
                f"{p.seconds * 1e3:.0f}",
                f"{p.compute_s * 1e3:.0f}",
                f"{p.stall_s * 1e3:.0f}",
                f"{p.ssd_bytes / 1e9:.2f}",
                f"{p.pcie_bytes / 1e9:.2f}",
                f"{100 * p.device_hits / max(p.uses, 1):.1f}",
                f"{100 * p.ram_hits / max(p.uses, 1):.1f}",
                f"{100 * ssd:.1f}",
                f"{100 * (1 - r.belady_not_ssd):.1f}",
            )
        )
    return columns(lines, left=3)


def columns(lines: list[tuple[str, ...]], left: int) -> str:
    """Rows of cells as aligned text: the first `left` columns to the left, the rest to the right."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        for line in lines
    )
