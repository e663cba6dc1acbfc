"""How close a model's router scores its runners-up: for each margin D, the share of (chosen expert, unchosen expert of
the same group) pairs whose selection scores (with the router's bias) lie within D. That is the chance cache-aware
routing (--cache-aware D) may take a given warm neighbour in place of a cold choice; the simulation's SwapModel uses
it to project the lever on a routing trace that has no scores (dsfp4/projection/simulate.py).

    python scripts/router_margins.py MODEL --text FILE [--margins 0.01,0.02,0.05,0.1] [--tokens 4096]

Prints one JSON object: per margin, `close` (the pair share) and `any` (the share of choices with at least one such
neighbour). Runs the model's prefill over the text's first tokens on the CPU, every expert resident.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np
import torch

from dsfp4.projection.levers import margin_shares
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.models.moe import Gate, expert_scores
from dsfp4.runtime.options import RunOptions


@click.command()
@click.argument("model", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--text", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True)
@click.option("--margins", default="0.01,0.02,0.05,0.1", show_default=True)
@click.option("--tokens", type=click.IntRange(16), default=4096, show_default=True)
def main(model: Path, text: Path, margins: str, tokens: int) -> None:
    seen: list[tuple[np.ndarray, np.ndarray, int]] = []

    def hook(gate: Gate, inputs: tuple, output: tuple) -> None:
        x = inputs[0]  # [T, D]
        choice = expert_scores(x, gate.weight, gate.args.score_func)  # [T, E]
        if gate.bias is not None:
            choice = choice + gate.bias
        seen.append((choice.float().numpy(), output[1].numpy(), gate.groups))

    options = RunOptions(device="cpu", max_context=512, prefill_chunk=512)
    with Engine(model, options) as engine, torch.inference_mode():
        for m in engine.model.modules():
            if isinstance(m, Gate):
                m.register_forward_hook(hook)
        ids = engine.tokenizer.encode(text.read_text(), special=False)
        for first in range(0, min(len(ids), tokens), options.max_context):
            engine.logits(ids[first : first + options.max_context])
    groups = seen[0][2]
    choice = np.concatenate([c for c, _, _ in seen])
    chosen = np.concatenate([i for _, i, _ in seen])
    report = margin_shares(choice, chosen, groups, [float(d) for d in margins.split(",")])
    print(json.dumps({"model": str(model), "choices": int(chosen.size), "groups": groups, "margins": report}))


if __name__ == "__main__":
    main()
