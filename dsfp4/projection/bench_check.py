"""`dsfp4 bench MODEL --routing TRACE --project FAMILY`: the bench model measured where the whole model is projected
from it (whole_model.py): its resident decode step gives the compute model, and at the whole model's share
of each machine's budgets its decode under the trace is measured beside the store's simulation of the same plan,
trace rows and links (the check of the simulation)."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

from dsfp4.errors import ConfigError
from dsfp4.layout.hot_profile import HOT_NAME, HotProfile
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.routing_trace import read_trace
from dsfp4.projection.first_token import first_token_table, first_tokens
from dsfp4.projection.long_context import context_decodes, context_table
from dsfp4.projection.machines import MACHINES, on_presets
from dsfp4.projection.simulate import ColdRecords, Links, Projection, StepCosts, simulate
from dsfp4.projection.whole_model import (
    decode_costs,
    efficiency,
    full_plan,
    n_moe_layers,
    project,
    spread,
    table,
)
from dsfp4.runtime.modes import EXACT
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.plan.planner import Plan, narrowed
from dsfp4.runtime.store.counters import disk_rate
from dsfp4.synthetic.releases import RELEASES
from dsfp4.tools.doctor import Ceilings

# the run's stages: the CLI shows them on a terminal (dsfp4/cli/progress.py)
log = logging.getLogger("dsfp4")


def share_plan(plan: Plan, gpu_share: float, ram_share: float, top_k: int, manifest: Manifest | None = None) -> Plan:
    """The bench model's plan with the whole model's shares of its records on the device and in RAM (at least one
    layer's experts on the device, the reads in flight in RAM); with `manifest`, the RAM's bytes split for its cold
    records as the planner splits them (narrowed)."""
    n = plan.total_records
    gpu = max(top_k, round(gpu_share * n))
    ram = max(plan.staging, math.ceil(ram_share * n))
    shared = dataclasses.replace(plan, gpu_slots=min(gpu, n), ram_slots=min(ram, n), cold_slots=0)
    return narrowed(shared, manifest) if manifest is not None else shared


def whole_model_share(plan: Plan, manifest: Manifest, family: str, machine: str) -> Plan:
    """The bench model's plan at the whole `family` model's share of `machine`'s budgets: share_plan with the shares
    of full_plan's records, the RAM split for the bench model's cold records."""
    _, full = full_plan(family, MACHINES[machine])
    n = full.total_records
    return share_plan(plan, full.gpu_slots / n, full.ram_slots / n, manifest.args.n_activated_experts, manifest)


def validate(
    model_dir: Path,
    manifest: Manifest,
    trace_path: Path,
    machine: str,
    family: str,
    options: RunOptions,
    links: Links,
    costs: StepCosts,
    prompt_tokens: int = 16,
    decode_tokens: int = 48,
) -> dict:
    """The bench model at the whole model's share of a machine's budgets under the trace: its measured decode
    against the simulation of the same plan, trace rows and links (the tiers start cold in both; the prompt's
    rows fill them untimed; both warm-start from the model's hot.json when it has one)."""
    from dsfp4.runtime.engine import Engine
    from dsfp4.runtime.models.load import plan_engine

    plan = whole_model_share(plan_engine(model_dir, options), manifest, family, machine)
    ids = read_trace(trace_path).ids
    trace = spread(ids, n_moe_layers(manifest))[: prompt_tokens + decode_tokens]
    hot = model_dir / HOT_NAME
    layers = sorted(manifest.experts)[: trace.shape[1]]
    # the simulation numbers the MoE layers 0..
    row = {layer: j for j, layer in enumerate(layers)}
    warm = [(row[k[0]], k[1]) for k in HotProfile.read(hot).ranked() if k[0] in row] if hot.is_file() else []
    # token ids: the routing comes from the trace
    prompt = list(range(10, 10 + prompt_tokens))
    with Engine(model_dir, options, plan=plan) as engine:
        g = engine.generate(prompt, max_tokens=decode_tokens, temperature=0)
        mode = engine.decode_mode
    measured = g.stats.decode_tok_s

    def simulated(disk: Links) -> Projection:
        return simulate(
            trace,
            plan.gpu_slots,
            plan.ram_slots,
            manifest.record.nbytes,
            disk,
            costs,
            options.policy,
            options.routing_recall if options.prefetch else None,
            manifest.args.n_routed_experts,
            warmup=prompt_tokens + 1,
            warm=warm,
            prefetch_reads=options.prefetch_reads,
            cold=_cold_records(manifest, row, plan.cold_slots),
        )

    sim = simulated(links)
    d = g.stats.derived()
    # the disk as this run found it (the doctor's rate is another moment's)
    store = g.stats.store
    run_disk = disk_rate(store.get("ssd_bytes", 0), store.get("ssd_read_s", 0), options.io_threads)
    at_run = simulated(dataclasses.replace(links, ssd=run_disk)) if run_disk else None
    return {
        "machine": machine,
        "gpu_slots": plan.gpu_slots,
        "ram_slots": plan.ram_slots,
        "cold_slots": plan.cold_slots,
        "total_records": plan.total_records,
        "measured_tok_s": measured,
        "simulated_tok_s": sim.tok_s,
        "error": sim.tok_s / measured - 1 if measured else None,
        "run_disk_gbps": run_disk / 1e9,
        "simulated_at_run_disk_tok_s": at_run.tok_s if at_run else None,
        "error_at_run_disk": at_run.tok_s / measured - 1 if at_run and measured else None,
        "measured_device_hit": d["gpu_hit_rate"],
        "measured_ram_hit": d["ram_hit_rate"],
        "simulated_device_hit": sim.device_hits / max(sim.uses, 1),
        "simulated_ram_hit": sim.ram_hits / max(sim.uses, 1),
        "measured_ssd_bytes_per_token": d["ssd_bytes_per_token"],
        "simulated_ssd_bytes_per_token": sim.ssd_bytes,
        "decode_mode": mode,
        "routing": g.stats.routing,
    }


def _cold_records(manifest: Manifest, row: dict[int, int], slots: int) -> ColdRecords | None:
    """The model's cold records (layout/cold.py) as the simulation numbers its MoE layers (`row`), `slots` RAM slots
    of their size (Plan.cold_slots)."""
    layouts = manifest.cold_layouts(row)
    if not layouts:
        return None
    keys = frozenset((j, e) for layer, j in row.items() for e in manifest.experts[layer].cold)
    sizes = tuple((row[layer], c.nbytes) for layer, c in layouts.items())
    return ColdRecords(keys, manifest.cold_nbytes(row), slots, sizes)


def compute_model(
    model_dir: Path, manifest: Manifest, c: Ceilings, options: RunOptions, prompts: list[str]
) -> tuple[dict, float, StepCosts, Links]:
    """What the check simulates with: the bench model's resident decode (every record on the device: its results,
    and its share of the HBM ceiling, the compute model's efficiency), the step costs at that efficiency and the
    ceilings' links."""
    from dsfp4.tools.bench import run_preset

    if not c.hbm_read_gbps:
        raise ConfigError("--project needs a GPU: its compute is measured on this machine's")
    log.info("resident decode of %s (every record on the device): the compute model", model_dir)
    resident = run_preset(model_dir, dataclasses.replace(options, preset="80g"), prompts, 32, c, "resident")
    eff = efficiency(manifest, 1 / resident["decode_tok_s"], c.hbm_read_gbps * 1e9)
    # the store reads a decode step's misses one record at a time, io_threads in flight: the doctor's random
    # record reads are that pattern (its best pattern, store_read_gbps, is the efficiency's ceiling instead)
    links = Links(c.random_read_gbps * 1e9, c.pinned_h2d_gbps * 1e9)
    return resident, eff, decode_costs(manifest, c.hbm_read_gbps * 1e9, eff), links


def run_projection(
    model_dir: Path, family: str, machines: list[str], c: Ceilings, options: RunOptions, prompts: list[str]
) -> dict:
    """`dsfp4 bench MODEL --routing TRACE --project FAMILY`: the bench model's resident decode (its compute), its
    decode at the whole model's share of each machine's budgets, measured and simulated side by side (the check of
    the simulation), and the whole model projected on each machine under each variant of the store."""
    manifest = Manifest.open(model_dir)
    if options.routing is None:
        raise ConfigError("--project needs --routing TRACE: the routing the projection replays")
    if options.levers() != EXACT:
        raise ConfigError(
            f"--project checks the simulation of exact routing; drop --mode {options.mode} and the lever flags (the "
            "modes are projected by scripts/project_levers.py)"
        )
    resident, eff, costs, links = compute_model(model_dir, manifest, c, options, prompts)
    checks = []
    for m in machines:
        log.info("%s at the whole model's share of %s: measured and simulated", model_dir, m)
        checks.append(validate(model_dir, manifest, options.routing, m, family, options, links, costs))
    ids = read_trace(options.routing).ids
    every = on_presets(machines) + list(RELEASES[family].published_on)
    log.info("projecting the whole %s on %s: decode, first tokens, long contexts", family, ", ".join(every))
    rows = project(family, ids, every, eff)
    firsts = first_tokens(family, ids, every)
    contexts = context_decodes(family, ids, every, eff)
    return {
        "efficiency": eff,
        "ceilings": c.to_dict(),
        "resident": resident,
        "bench_costs": dataclasses.asdict(costs),
        "bench_links": dataclasses.asdict(links),
        "checks": checks,
        "projection": [r.to_dict() for r in rows],
        "table": table(rows),
        "first_token": [r.to_dict() for r in firsts],
        "first_token_table": first_token_table(firsts),
        "context_decode": [r.to_dict() for r in contexts],
        "context_table": context_table(contexts),
        "machines": {k: MACHINES[k].about for k in {r.machine for r in rows}},
    }
