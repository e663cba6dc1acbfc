"""What an Engine sets up as it opens, besides the model: routing by a trace, the expert tiers' warm start, the MoE
kernels compiled and the decode step's CUDA graphs captured before the first answer."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dsfp4.kernels.moe.waves import warm_up_waves
from dsfp4.layout.hot_profile import HOT_NAME, HotProfile
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.model_args import ModelArgs
from dsfp4.runtime.generate.decode_graph import DecodeGraphs
from dsfp4.runtime.models.kernel_warm_up import warm_up_backbone
from dsfp4.runtime.models.protocol import Model
from dsfp4.runtime.models.trace_routing import TraceRouting, attach
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.store.placement import place_records
from dsfp4.runtime.store.split_placement import place_split
from dsfp4.runtime.store.split_store import SplitStore

# stage lines of an engine's start: the CLI shows them on a terminal (dsfp4/cli/progress.py)
log = logging.getLogger("dsfp4")


def trace_routing(model: Model, a: ModelArgs, o: RunOptions, device: torch.device, max_context: int) -> TraceRouting:
    """The MoE layers route by the trace of --routing (runtime/models/trace_routing.py)."""
    layers = [b.ffn.layer for b in model.layers if b.moe]
    # a pass: a prefill chunk, a layer-wise pass's feed-forward group, or an MTP verify step
    chunk = max(min(max(o.prefill_chunk, model.experts.plan.prefill_group), max_context), 2)
    routing = TraceRouting(
        o.routing, layers, a.n_routed_experts, a.n_activated_experts, a.route_scale, device, chunk, o.routing_recall
    )
    attach(model, routing)
    return routing


def warm_start(model: Model, model_dir: Path, conversion: Manifest, zero_copy: bool) -> str | None:
    """The expert tiers filled before the first generation: from the folder's hot.json when it belongs to
    `conversion` (the manifest on disk: a run of fewer experts a token reads the same conversion's hottest); with
    --zero-copy, kernels that read RAM's records in place where the device and RAM hold them all -> a note for the
    engine's (a split's: it maps nothing)."""
    hot = model_dir / HOT_NAME
    profile = HotProfile.read(hot).check(conversion, hot) if hot.is_file() else None
    kernel = model.moe_kernel
    log.info("warm start: the expert tiers filled%s", f" from {HOT_NAME}" if profile is not None else "")
    zero_copy = zero_copy and kernel is not None and kernel.triton
    if isinstance(model.experts, SplitStore):
        return place_split(model.experts, profile, zero_copy)
    place_records(model.experts, profile, zero_copy=zero_copy)
    return None


def warm_up_kernels(model: Model, dtype: torch.dtype, a: ModelArgs, chunk: int) -> None:
    """Triton compiles the MoE kernels and the backbone's here, for every prompt length, not in a request's TTFT: where
    experts stream (the store does not reach every record itself, so MoE takes the store's waves), the compacted
    wave calls' variants too."""
    if model.moe_kernel is not None:
        log.info("compiling the MoE kernels")
        # each card's kernel on its slots (one device: the one pair)
        pairs = {id(b.ffn.kernel): (b.ffn.kernel, b.ffn.experts.gpu) for b in model.layers if b.moe}
        for kernel, records in pairs.values() or [(model.moe_kernel, model.experts.gpu)]:
            kernel.warm_up(dtype, records, a.n_routed_experts, chunk)
            if not model.experts.visible:
                warm_up_waves(kernel, dtype, records, chunk)
    log.info("compiling the backbone's kernels")
    warm_up_backbone(model, chunk)


def captured_graphs(
    model: Model, max_context: int, device: torch.device, recording: bool, routing: TraceRouting | None
) -> DecodeGraphs:
    """The decode step's CUDA graphs, captured now for every batch size of the plan, not in the first answer's
    decode."""
    log.info("capturing the decode step's CUDA graphs")
    graphs = DecodeGraphs(model, max_context, device, recording, routing)
    graphs.capture_all(model.experts.plan.max_batch)
    return graphs
