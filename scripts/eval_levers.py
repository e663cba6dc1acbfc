"""The quality cost of the lossy levers where they act: `dsfp4 eval` of a trained model (scripts/train_small.py, then
`convert`) at the whole model's share of a machine's budgets, token by token (the decode regime: a cold record is
cold for one token), against a reference's logits (`dsfp4 eval --save-logits`, e.g. of exact NVFP4).

    python scripts/eval_levers.py MODEL --text FILE --reference REF [--family v3] [--machine 16g] \
        [--chunk 1] SETTING...

SETTING: a mode name (runtime/modes.py) or THRESHOLD:MARGIN (0:0 is exact); --experts-per-token K runs each with K
routed experts a token. One JSON line per setting: KL mean and
p99, top-1 agreement and perplexity ratio against the reference, shares of choices left out and swapped, SSD
megabytes per token, and tokens per second (on a GPU at --chunk 1: the host's per-layer work shows); and the model's
cold records as stored: its cold recipe (`profile-hot --repack --cold-bits` or `--cold-recipe`; none: "-") and bits
per routed weight of its main MoE layers, scales included.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from dsfp4.projection.bench_check import whole_model_share
from dsfp4.projection.machines import MACHINES
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.generate.tokenizer import ChatTokenizer
from dsfp4.runtime.models.load import plan_engine, run_target
from dsfp4.runtime.modes import Levers, parse_levers
from dsfp4.runtime.options import RunOptions
from dsfp4.tools import logprobs_file
from dsfp4.tools.evaluate import evaluate, windows

FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


def setting(text: str) -> tuple[str, Levers]:
    try:
        return text, parse_levers(text)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command()
@click.argument("model", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("settings", nargs=-1, required=True)
@click.option("--text", type=FILE, required=True)
@click.option("--reference", type=FILE, required=True)
@click.option("--family", type=click.Choice(["v3", "v4"]), default="v3", show_default=True)
@click.option("--machine", type=click.Choice(list(MACHINES)), default="16g", show_default=True)
@click.option("--chunk", type=click.IntRange(1), default=1, show_default=True, help="Tokens per forward pass.")
@click.option("--device", default="cpu", show_default=True)
@click.option("--experts-per-token", type=click.IntRange(0), default=0, help="Experts a token, every setting (0: all).")
def main(
    model: Path,
    settings: tuple[str, ...],
    text: Path,
    reference: Path,
    family: str,
    machine: str,
    chunk: int,
    device: str,
    experts_per_token: int,
) -> None:
    head, lp = logprobs_file.read(reference)
    ids = ChatTokenizer(model).encode(text.read_text(), special=False)  # the same tokens for every setting
    for name, levers in map(setting, settings):
        options = RunOptions(
            device=device,
            max_context=head["context"],
            prefill_chunk=chunk,
            expert_threshold="auto" if levers.adaptive else levers.expert_threshold,
            cache_aware=levers.cache_aware,
            experts_per_token=experts_per_token,
        )
        # the shape the run sees (--experts-per-token)
        manifest = run_target(model, options)[1]
        plan = whole_model_share(plan_engine(model, options), manifest, family, machine)
        with Engine(model, options, plan=plan) as engine:
            if levers.adaptive:  # the adaptive threshold at the machine's ratio of SSD to PCIe rates, not this one's
                ratio = MACHINES[machine].links.ssd / MACHINES[machine].links.pcie
                engine.model.experts.rules.levers = dataclasses.replace(levers, hide_ratio=levers.hide_ratio or ratio)
            bos = head["bos"]
            wins = windows(len(ids), head["context"], head["stride"], bos)
            before = engine.model.experts.counters.snapshot()
            top_k = lp.top_ids.shape[1]
            bos_id = engine.tokenizer.bos_id if bos else None
            r = evaluate(engine.logits, ids, wins, bos_id, head["context"], head["stride"], top_k, lp)
            after = engine.model.experts.counters.snapshot()
            per_token = engine.model.args.n_activated_experts
        d = {key: after[key] - before[key] for key in after}
        chosen = max(d["expert_uses"] + d["skipped"], 1)
        out = r.to_dict()
        row = {
            "setting": name,
            "expert_threshold": levers.expert_threshold,
            "adaptive": levers.adaptive,
            "cache_aware": levers.cache_aware,
            "experts_per_token": per_token,
            "machine": machine,
            "gpu_slots": plan.gpu_slots,
            "ram_slots": plan.ram_slots,
            "cold_recipe": str(manifest.cold_recipe() or "-"),
            # the main model's MoE layers (the MTP block's records are not run)
            "routed_bits": round(manifest.routed_bits(b for b in manifest.experts if b < manifest.args.n_layers), 4),
            "kl_mean": out["kl_mean"],
            "kl_p99": out["kl_p99"],
            "top1": out["top1_agreement"],
            "ppl_ratio": out["perplexity_ratio"],
            "skipped_share": d["skipped"] / chosen,
            "swapped_share": d["swapped"] / chosen,
            "ssd_mb_per_token": d["ssd_bytes"] / r.tokens / 1e6,
            "tok_s": out["tok_s"],  # forward passes of `chunk` tokens: the host's share shows at --chunk 1
        }
        click.echo(json.dumps(row))


if __name__ == "__main__":
    main()
