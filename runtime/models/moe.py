"""The MoE feed-forward: router (Gate), routed experts through the expert interface, shared experts.

Legend: T tokens, D dim, E routed experts, K activated experts per token, G expert groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from dsfp4.kernels.backend import DECODE_TOKENS, use_kernels
from dsfp4.kernels.linear import linear
from dsfp4.kernels.moe.kernel import MoEKernel
from dsfp4.kernels.router.gate_scores import gate_scores, gate_scores_ref
from dsfp4.kernels.router.route import can_route, chosen_weights, route, route_ref
from dsfp4.kernels.swiglu import swiglu
from dsfp4.layout.model_args import ModelArgs
from dsfp4.runtime.models.cache_aware import Swap
from dsfp4.runtime.models.weights import Weights

if TYPE_CHECKING:
    from dsfp4.runtime.models.trace_routing import TraceRouting
from dsfp4.runtime.store.expert_store import ExpertStore
from dsfp4.runtime.store.host_lane import HostJob, abandoned_on_error


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), for the dense layers and the shared experts (clamped at `limit`)."""

    def __init__(self, prefix: str, dim: int, inter_dim: int, w: Weights, limit: float = 0.0):
        super().__init__()
        self.w1 = w.matrix(prefix + "w1", (inter_dim, dim))
        self.w3 = w.matrix(prefix + "w3", (inter_dim, dim))
        self.w2 = w.matrix(prefix + "w2", (dim, inter_dim))
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(swiglu(linear(x, self.w1), linear(x, self.w3), self.limit), self.w2)


GROUPED_METHODS = ("noaux_tc", "group_limited_greedy")  # "greedy" ignores expert groups (V2-Lite)


class Gate(nn.Module):
    """Scores every expert (sigmoid, softmax or sqrt(softplus), in fp32), keeps the best n_limited_groups groups,
    picks the top K, and weights them by their scores (without the selection bias), renormalized if configured,
    times route_scale. V3: sigmoid + bias, group score = sum of the group's top 2. V2: softmax, group score =
    max. V4: sqrt(softplus) + bias, no groups."""

    def __init__(self, args: ModelArgs, layer: int, w: Weights):
        super().__init__()
        p, self.args = f"layers.{layer}.ffn.gate.", args
        self.weight = w.plain(p + "weight", (args.n_routed_experts, args.dim), torch.float32)  # as transformers
        has_bias = args.layer_has_gate_bias(layer)
        bias = w.plain(p + "bias", (args.n_routed_experts,), torch.float32) if has_bias else None
        self.bias = bias  # kept in fp32 from the file: a bf16 round could flip near-tied selections
        grouped = args.n_expert_groups > 1 and args.topk_method in GROUPED_METHODS
        self.groups = args.n_expert_groups if grouped else 1
        self.kernel = use_kernels(self.weight) and can_route(args.n_routed_experts, self.groups)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (weights [T, K], expert ids [T, K]); `tokens` is the hash gate's, unused here."""
        return self.scored(x, tokens)[:2]

    def scored(
        self, x: torch.Tensor, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """forward, and every expert's score [T, E] (without the bias) that cache-aware routing weighs."""
        a = self.args
        scores = expert_scores(x, self.weight, a.score_func)  # [T, E]
        select = route if self.kernel else route_ref  # one launch on CUDA (kernels/router/route.py)
        weights, ids = select(
            scores, self.bias, self.groups, a.n_limited_groups, a.n_activated_experts, a.norm_topk_prob, a.route_scale
        )
        return weights, ids, scores

    def swap(self, weights: torch.Tensor, ids: torch.Tensor, scores: torch.Tensor, margin: float) -> Swap:
        """Cache-aware routing's view of this step (runtime/models/cache_aware.py)."""
        a = self.args
        return Swap(ids, weights, scores, self.bias, self.groups, a.norm_topk_prob, a.route_scale, margin)


class HashGate(nn.Module):
    """V4's first layers: token id t goes to experts tid2eid[t] (so they are known before the layer runs);
    the router's scores still weight them."""

    def __init__(self, args: ModelArgs, layer: int, w: Weights):
        super().__init__()
        p, self.args = f"layers.{layer}.ffn.gate.", args
        self.weight = w.plain(p + "weight", (args.n_routed_experts, args.dim), torch.float32)
        self.tid2eid = w.plain(p + "tid2eid", (args.vocab_size, args.n_activated_experts), torch.int64)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D], tokens: [T] -> (weights [T, K], expert ids [T, K])."""
        a, indices = self.args, self.experts_of(tokens)
        scores = expert_scores(x, self.weight, a.score_func)  # [T, E]
        return chosen_weights(scores, indices, a.norm_topk_prob, a.route_scale), indices

    def experts_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [...] -> their experts [..., K]."""
        return self.tid2eid[tokens]


def expert_scores(x: torch.Tensor, weight: torch.Tensor, score_func: str) -> torch.Tensor:
    """x: [T, D], weight: [E, D] fp32 -> every expert's score [T, E], computed in fp32 (one launch at decode on
    CUDA: kernels/router/gate_scores.py)."""
    return (gate_scores if use_kernels(x) else gate_scores_ref)(x, weight, score_func)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, w: Weights, experts: ExpertStore, kernel: MoEKernel):
        super().__init__()
        self.layer, self.experts, self.kernel = layer, experts, kernel
        self.gate = HashGate(args, layer, w) if args.is_hash_layer(layer) else Gate(args, layer, w)
        inter, p = args.n_shared_experts * args.moe_inter_dim, f"layers.{layer}.ffn.shared_experts."
        self.shared_experts = MLP(p, args.dim, inter, w, args.swiglu_limit) if inter else None
        # set by the model: the next MoE layer and its predicted experts from (this layer's residual, tokens)
        self.next_router: tuple[int, Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]] | None = None
        self.observe: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None  # a RoutingRecorder
        self.trace: TraceRouting | None = None  # routes by a routing trace instead (models/trace_routing.py)
        # set while a decode step is captured in pieces (runtime/generate/decode_graph.py): ends the piece before this
        # layer's loads and gives the offsets the next piece's kernel reads once they are done
        self.cut: Callable[[LayerLoad], torch.Tensor] | None = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: [B, T, D] normed input; residual: the stream(s) x came from, for predicting the next layer's
        experts; tokens: [B, T] ids (hash layers route by them)."""
        shape = x.shape
        x = x.view(-1, shape[-1])  # [T, D]
        tokens = None if tokens is None else tokens.reshape(-1)
        # cache-aware routing swaps choices by the router's scores: not a trace's choice, nor a hash layer's table
        margin = self.experts.levers.cache_aware if self.trace is None and isinstance(self.gate, Gate) else 0.0
        weights, indices, scores = self.gate.scored(x, tokens) if margin else (*self.gate(x, tokens), None)
        if self.trace is not None:  # the router ran (its cost stays); the trace's choice replaces its own
            weights, indices = self.trace.route(self.layer, x.shape[0])
        if self.observe is not None:
            self.observe(self.layer, weights, indices)
        # the shared experts' output goes to the routed kernel, which adds it as it sums each token's experts (on
        # CUDA, up to 16 tokens); streamed waves add it after their sum
        shared = None if self.shared_experts is None else self.shared_experts(x)  # [T, D]
        if self.experts.visible:  # nothing to bring in: the kernel finds every record itself, no host sync
            self.experts.count_step(self.layer, indices)
            offsets = self.experts.offsets(self.layer)
            return self.kernel(x, indices, weights, self.experts.gpu, offsets, add=shared).view(shape)
        ask, after = [indices.flatten()], None
        if self.next_router is not None and residual is not None:
            ask.append(self.next_router[1](residual, tokens).flatten())  # next layer's choice
            after = self.next_router[0]
        thresholded = self.experts.levers.expert_threshold > 0
        swap = self.gate.swap(weights, indices, scores, margin) if margin else None
        lane = None
        if self.experts.lane is not None and x.shape[0] <= DECODE_TOKENS:  # a decode step: the host may take RAM hits
            lane = HostInputs.captured(x, weights, self.experts.n_experts) if self.cut else HostInputs(x, weights)
        ask = torch.cat(ask)
        load = LayerLoad(self.layer, ask, indices.numel(), after, weights if thresholded else None, swap, lane)
        if self.cut is not None:  # captured: the loads run between this piece and the next, at each replay
            offsets = self.cut(load)
            if thresholded:  # one token: the expert it leaves out is exactly the one without a slot (offset -1)
                kept = offsets[indices] >= 0
                weights = kept_weights(weights, kept if lane is None else kept | lane.kept[indices])
            if lane is not None:  # added in x's dtype (eager steps add it in fp32): one rounding apart
                shared = lane.out if shared is None else shared + lane.out
            return self.kernel(x, indices, weights, self.experts.gpu, offsets, add=shared).view(shape)
        parts = []
        chosen, waves, drop, job = load.waves(self.experts)
        with abandoned_on_error(job):
            if drop is not None and any(drop):
                weights = kept_weights(weights, ~torch.tensor(drop, device=indices.device).view(indices.shape))
            for wave in waves:  # one wave unless slots run short
                offsets = self.experts.offsets(self.layer, None if len(wave) == len(chosen) else wave)
                parts.append(self.kernel(x, indices, weights, self.experts.gpu, offsets))  # [T, D]
        if job is not None:  # the host's sum, in fp32 like several waves', copied up behind the waves' kernels
            y_host = job.result()
            parts.append(y_host.pin_memory().to(x.device, non_blocking=True) if x.is_cuda else y_host)
        # several parts add up in fp32: each is rounded once, as one wave would be
        y = parts[0].to(x.dtype) if len(parts) == 1 else torch.stack(parts).float().sum(0).to(x.dtype)
        return (y if shared is None else y + shared).view(shape)


def kept_weights(weights: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """weights: [T, K], keep: [T, K] bool -> the kept experts' weights rescaled to each token's former sum (the
    experts left out weigh 0), as DeepSeek-V3's top-k renormalization would weight the experts that remain."""
    kept = weights * keep
    return kept * (weights.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True).clamp_min(torch.finfo(kept.dtype).tiny))


@dataclass(frozen=True)
class HostInputs:
    """What the CPU lane (runtime/store/host_lane.py) reads of a layer step: its input x [T, D] and the tokens'
    weights [T, K] (after any cache-aware swap). Captured steps also hold the device buffers the next piece reads: `out`
    [T, D], the host's sum, added to the layer's output, and `kept` [E] bool, the experts the host computed (they
    have no slot, yet are not left out)."""

    x: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor | None = None
    kept: torch.Tensor | None = None

    @classmethod
    def captured(cls, x: torch.Tensor, weights: torch.Tensor, n_experts: int) -> HostInputs:
        return cls(x, weights, torch.zeros_like(x), torch.zeros(n_experts, dtype=torch.bool, device=x.device))

    def submit(
        self, store: ExpertStore, host: dict[int, int], ids: list[int], skipped: set[int], drop: list[bool] | None
    ) -> HostJob:
        """Start the host's experts (expert -> RAM slot), weighted as the device weighs the same choices: renormalized
        over the choices that are not left out (per choice when eager, by expert when captured)."""
        k = self.weights.shape[-1]
        chosen = torch.tensor(ids, dtype=torch.int64).view(-1, k)  # [T, K]
        weights = self.weights.float().cpu()  # [T, K]
        if self.out is not None and skipped:
            weights = kept_weights(weights, ~torch.isin(chosen, torch.tensor(sorted(skipped))))
        elif self.out is None and drop is not None and any(drop):
            weights = kept_weights(weights, ~torch.tensor(drop).view(-1, k))
        return store.compute_on_host(host, self.x.float().cpu(), chosen, weights)

    def fill(self, job: HostJob | None) -> None:
        """Captured: the host's sum and experts into the buffers the next piece reads (zero when it took none)."""
        if job is None:
            self.out.zero_()
            self.kept.zero_()
            return
        self.out.copy_(job.result().to(self.out.dtype).pin_memory(), non_blocking=True)
        kept = torch.zeros(self.kept.shape, dtype=torch.bool)
        kept[job.experts] = True
        self.kept.copy_(kept.pin_memory(), non_blocking=True)


@dataclass(frozen=True)
class LayerLoad:
    """What a streamed MoE layer asks the store for: the experts its tokens chose (ids[:chosen]) and, when
    `after` is set, those predicted for that next MoE layer (ids[chosen:]), to prefetch; with `weights` (the
    tokens' [T, K], under an expert threshold) tokens may leave cold experts out (ExpertStore.skip_cold); with `swap`
    (cache-aware routing) they may first trade a cold expert for a warm one (runtime/models/cache_aware.py); with `lane`
    the store may compute some RAM hits on the host (runtime/store/host_lane.py)."""

    layer: int
    ids: torch.Tensor  # [chosen + predicted] on the device
    chosen: int
    after: int | None
    weights: torch.Tensor | None = None  # [T, K]
    swap: Swap | None = None  # cache-aware routing's view of the step
    lane: HostInputs | None = None

    def waves(self, store: ExpertStore) -> tuple[list[int], Iterator[list[int]], list[bool] | None, HostJob | None]:
        """Read the ids (the one host sync of the layer) -> (the distinct chosen experts, the store's waves of those
        the device computes: each yielded once its records are on the device for compute queued next, the [T * K]
        choices that tokens left out: None without a threshold, the host's job: None when it takes no expert)."""
        ids = self.ids.tolist()
        if self.swap is not None:  # before the threshold: a swapped-in expert is warm, so never left out
            ids[: self.chosen] = self.swap.apply(store, self.layer, ids[: self.chosen])
        skipped, drop = set(), None
        if self.weights is not None:
            top_k = self.weights.shape[-1]
            skipped, drop = store.skip_cold(self.layer, ids[: self.chosen], self.weights.flatten().tolist(), top_k)
        chosen = sorted(set(ids[: self.chosen]) - skipped)
        prefetch = None if self.after is None else (self.after, sorted(set(ids[self.chosen :])))
        host = store.host_split(self.layer, chosen) if self.lane is not None else {}
        job = None
        if host:
            try:
                job = self.lane.submit(store, host, ids[: self.chosen], skipped, drop)
            except BaseException:
                store.release_host(host)
                raise
        device = [e for e in chosen if e not in host]
        return chosen, store.load_waves(self.layer, device, prefetch, host=list(host)), drop, job
