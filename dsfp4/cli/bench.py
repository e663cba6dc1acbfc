"""`dsfp4 bench` (end-to-end speed of a converted model under hardware presets: dsfp4/tools/bench.py) and `dsfp4
doctor` (this machine's ceilings, which bench reads: dsfp4/tools/doctor.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from dsfp4.cli.options import CUDA_GRAPH, EXISTING_DIR, PATH, ZERO_COPY, routing_options, store_options
from dsfp4.runtime.plan.budget import PRESETS


def _command(ctx: click.Context) -> str:
    """The command line this run is equivalent to (every option, defaults included)."""
    parts = ["dsfp4", "bench"]
    for name, value in ctx.params.items():
        if name == "model":
            parts.insert(2, str(value))
        elif name == "presets":
            parts += [f"--preset {p}" for p in value]
        elif isinstance(value, bool):
            # the flags default to on: only --no-X shows
            parts += [] if value else [f"--no-{name.replace('_', '-')}"]
        elif value is not None:
            parts.append(f"--{name.replace('_', '-')} {value}")
    return " ".join(parts)


@click.command()
@click.argument("model", type=EXISTING_DIR)
@click.option(
    "--preset",
    "presets",
    multiple=True,
    type=click.Choice(list(PRESETS)),
    help="Emulate a machine class (its GPU and RAM budgets); repeat for several. Default: this machine's.",
)
@click.option("--gpu-mem", help="Also run under this device budget (a size such as 6G), for a machine no preset names.")
@click.option("--cpu-mem", help="RAM budget of that run (a size such as 8G).")
@click.option("--prompts", type=click.IntRange(1, 64), default=4, show_default=True, help="Fixed prompts per preset.")
@click.option("--max-tokens", type=click.IntRange(2), default=64, show_default=True, help="Tokens per answer.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--max-context", type=click.IntRange(2), default=2048, show_default=True)
@click.option(
    "--ceilings",
    type=PATH,
    help="The doctor's JSON (default: ~/.cache/dsfp4/doctor.json; measured on MODEL's disk now when missing).",
)
@ZERO_COPY
@CUDA_GRAPH
@store_options
@routing_options
@click.option(
    "--project",
    type=click.Choice(["v3", "v4"]),
    help="With --routing: run MODEL (a bench model of that family) at the whole model's share of each --preset's "
    "budgets, measured beside the store's simulation of the same, and project the whole DeepSeek-V3 (or "
    "V4-Flash) on each machine class.",
)
@click.option("--out", type=PATH, default=Path("bench"), show_default=True, help="Folder for the reports.")
def bench(
    model: Path,
    presets: tuple[str, ...],
    prompts: int,
    max_tokens: int,
    device: str,
    max_context: int,
    ceilings: Path | None,
    zero_copy: bool,
    cuda_graph: bool,
    out: Path,
    gpu_mem: str | None,
    cpu_mem: str | None,
    routing: Path | None,
    routing_recall: float,
    project: str | None,
    **store,
) -> None:
    """Measure MODEL end to end: TTFT, prefill and decode tok/s, bytes per token per tier, hit rates (also
    per layer), waiting against computing, peak memory, and efficiency (the floor the doctor's ceilings
    allow / the measured time) for each --preset; writes bench.json, bench.csv and bench.html to --out."""
    from dsfp4.runtime.models.load import plan_engine
    from dsfp4.runtime.options import RunOptions
    from dsfp4.tools.bench import commit, device_name, prompt_set, run_preset
    from dsfp4.tools.bench_report import write_reports
    from dsfp4.tools.doctor import default_path, folder_model, load, measure

    path = ceilings or default_path()
    if path.is_file():
        c = load(path)
    else:
        click.echo(f"no ceilings at {path}: measuring them (dsfp4 doctor)", err=True)
        c = measure(model, model=folder_model(model))
        c.save(path)
    texts = prompt_set(prompts)
    if project is not None:
        options = RunOptions(
            device=device, max_context=max_context, routing=routing, routing_recall=routing_recall, **store
        )
        _project(model, project, list(presets) or ["16g", "24g"], c, options, texts[:1], out)
        return
    custom = [{"gpu_mem": gpu_mem, "cpu_mem": cpu_mem}] if gpu_mem or cpu_mem else []
    # every budget checked and planned before the first runs: a bad one fails now, not after the others; each run
    # follows its plan, which a later process, larger by the runs before it, would not plan again the same
    runs = []
    for budget in [{"preset": p} for p in presets] + custom or [{}]:
        knobs = dict(device=device, max_context=max_context, zero_copy=zero_copy, cuda_graph=cuda_graph, **store)
        options = RunOptions(**knobs, routing=routing, routing_recall=routing_recall, **budget)
        plan = plan_engine(model, options)
        label = budget.get("preset") or " ".join(f"--{k.replace('_', '-')} {v}" for k, v in budget.items() if v)
        runs.append((label, options, plan))
    meta = {
        "commit": commit(),
        "command": _command(click.get_current_context()),
        "model": str(model.resolve()),
        "device": device_name(RunOptions(device=device)),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "ceilings": c.to_dict(),
        "max_tokens": max_tokens,
    }
    results: list[dict] = []
    for label, options, plan in runs:
        click.echo(f"{label or 'this machine'}: {prompts} prompts x {max_tokens} tokens ...", err=True)
        r = run_preset(model, options, texts, max_tokens, c, label or None, plan)
        eff = f", efficiency {r['efficiency']:.0%}" if r["efficiency"] is not None else ""
        click.echo(
            f"{r['preset']}: decode {r['decode_tok_s']:.2f} tok/s, prefill {r['prefill_tok_s']:.1f} tok/s, "
            f"TTFT {r['ttft_s']:.2f} s, device hits {r['gpu_hit_rate']:.0%}{eff} ({r['decode_mode']})"
            + (f"; {r['kernel_word']}" if r["kernel_word"] else "")
        )
        results.append(r)
        # after each run: a later failure keeps what was measured
        paths = write_reports(out, meta, results)
    for p in paths:
        click.echo(f"wrote {p}", err=True)


@click.command()
@click.argument("folder", type=EXISTING_DIR, default=".")
@click.option("--out", type=PATH, help="Save the JSON here (default: ~/.cache/dsfp4/doctor.json).")
@click.option(
    "--scratch",
    default="2G",
    show_default=True,
    help="Size of the scratch file written (then deleted) when FOLDER holds no converted model.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the ceilings as JSON on stdout.")
def doctor(folder: Path, out: Path | None, scratch: str, as_json: bool) -> None:
    """Measure this machine's ceilings (GPU memory and PCIe speed, the disk under FOLDER, RAM, CPU) in about
    a minute, say what will limit decoding, and save them for `dsfp4 bench`.

    FOLDER is where the model lives or will (default: here): a converted model's expert files are read as
    they are; elsewhere a scratch file is written, read and deleted."""
    from dsfp4.runtime.plan.budget import parse_size
    from dsfp4.tools.doctor import default_path, folder_model, measure, model_expert_bytes, table, verdict

    model = folder_model(folder)
    c = measure(folder, parse_size(scratch, "--scratch"), model=model)
    path = out or default_path()
    c.save(path)
    if as_json:
        click.echo(json.dumps(c.to_dict(), indent=1))
        return
    click.echo(table(c))
    for line in verdict(c, model_expert_bytes(model)):
        click.echo(line)
    click.echo(f"saved: {path}", err=True)


def _project(model: Path, family: str, machines: list[str], c, options, prompts: list[str], out: Path) -> None:
    """--project: the check of the simulation on MODEL, then the whole model projected (projection/whole_model.py)."""
    from dsfp4.projection.bench_check import run_projection

    r = run_projection(model, family, machines, c, options, prompts)
    click.echo(f"resident decode {r['resident']['decode_tok_s']:.1f} tok/s: {r['efficiency']:.0%} of HBM", err=True)
    for check in r["checks"]:
        at_run = check.get("simulated_at_run_disk_tok_s")
        # the same simulation at the disk rate the run itself read at: the store's model apart from the disk's moods
        run_disk = (
            f"; at this run's disk ({check['run_disk_gbps']:.2f} GB/s) {at_run:.2f} ({check['error_at_run_disk']:+.0%})"
            if at_run
            else ""
        )
        click.echo(
            f"{check['machine']} share ({check['gpu_slots']} device, {check['ram_slots']} RAM slots of "
            f"{check['total_records']}): measured {check['measured_tok_s']:.2f} tok/s, simulated "
            f"{check['simulated_tok_s']:.2f} ({check['error']:+.0%}){run_disk}"
        )
    click.echo(r["table"])
    click.echo(r["first_token_table"])
    click.echo(r["context_table"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "projection.json").write_text(json.dumps(r, indent=1) + "\n")
    click.echo(f"wrote {out / 'projection.json'}", err=True)
