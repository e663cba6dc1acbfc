"""Layer-wise routing profile (`dsfp4 profile-hot`): every calibration token through layer L, then L+1.

Why layer by layer: each MoE layer's records are read from the SSD once per run, into the RAM cache (as
much of the next layer's as fits while this one computes), not once per sequence, so a profile costs one
pass over the expert files wherever RAM holds one layer, even when the model does not fit in memory.
The pass is a long prompt's (runtime/generate/layer_pass.py): each sequence goes through each block's attention in
the chunks of ordinary prefill (`dsfp4 run --raw` with the same --prefill-chunk), the block's KV cache holding the
sequence's earlier chunks, and its feed-forward takes the plan's prefill_group tokens at once, so the routing, and so
the counts, are those of ordinary generation.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dsfp4.layout.hot_profile import HotProfile
from dsfp4.layout.routing_trace import RoutingTrace
from dsfp4.runtime.generate.layer_pass import prepare, run_blocks
from dsfp4.runtime.generate.tokenizer import ChatTokenizer
from dsfp4.runtime.models.load import load_model, plan_run, run_target
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.plan.planner import Plan
from dsfp4.runtime.profile.calibration import calibration
from dsfp4.runtime.profile.recorder import RoutingRecorder


@dataclass
class ProfileRun:
    profile: HotProfile
    trace: RoutingTrace | None
    plan: Plan
    # the expert store's, for the whole pass
    counters: dict[str, float]
    seconds: float
    notes: list[str]


def profile_model(
    model_dir: Path,
    options: RunOptions,
    prompts: Path | None,
    chat_format: bool,
    tokens: int,
    trace: bool = False,
    plan: Plan | None = None,
    on_start: Callable[[Plan, int, int], None] = lambda plan, n_layers, n_tokens: None,
    on_layer: Callable[[int, dict[str, float]], None] = lambda done, counters: None,
) -> ProfileRun:
    """Profile MODEL on calibration text: sequences of options.max_context tokens, each prefilled in
    chunks of options.prefill_chunk, under the run's budgets (or `plan`, for tests and benchmarks).
    on_start gets the plan, the layer count and the tokens, on_layer the layers done and the store's counters."""
    t0 = time.perf_counter()
    device, manifest, seq_len, dtype = run_target(model_dir, options)
    calib = calibration(ChatTokenizer(model_dir), prompts, chat_format, tokens, seq_len)
    # V4's residual is hc_mult streams of dim
    streams = max(1, manifest.args.hc_mult)
    hidden_bytes = calib.tokens * streams * manifest.args.dim * torch.empty((), dtype=dtype).element_size()
    plan = plan or plan_run(manifest, device, dtype, seq_len, options, False, host_extra=hidden_bytes)
    # predicting the next layer means nothing here
    options = dataclasses.replace(options, prefetch=False)
    model = load_model(model_dir, device, dtype, seq_len, manifest=manifest, options=options, plan=plan)
    notes = list(model.experts.notes)
    if calib.available < tokens:
        notes.append(f"the calibration text holds {calib.available} tokens, fewer than --tokens {tokens}")
    n, pool = manifest.args.n_routed_experts, model.experts.ram_pool
    if any(len(pool.fitting([(layer, e) for e in range(n)])) < n for layer in plan.expert_layers):
        notes.append(
            f"the RAM cache holds {plan.ram_slots} records, less than one layer's {n} (of each size: record-sized and "
            f"cold): records are read from the SSD more than once (raise --cpu-mem)"
        )
    recorder = None
    try:
        recorder = RoutingRecorder(model, trace)
        on_start(plan, len(model.layers), calib.tokens)
        store = model.experts
        starts = [0] * len(calib.sequences)
        lp = prepare(model, calib.sequences, starts, options.prefill_chunk, plan.prefill_group, plan.attention_group)
        for i, share in run_blocks(model, lp):
            if share == 1.0:
                on_layer(i + 1, store.counters.snapshot())
        # every layer has seen every token
        recorder.commit([t for s in calib.sequences for t in s])
        model.experts.sync()
        profile = recorder.profile(manifest.exact_sha256(), (calib.source,))
        return ProfileRun(
            profile,
            recorder.routing_trace() if trace else None,
            plan,
            model.experts.counters.snapshot(),
            time.perf_counter() - t0,
            notes,
        )
    finally:
        if recorder is not None:
            # the recorder and the model point at each other: let both go now
            recorder.detach()
        model.experts.close()
