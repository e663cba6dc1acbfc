"""The MoE feed-forward: router (Gate), routed experts through the expert interface, shared experts.

Legend: T tokens, D dim, E routed experts, K activated experts per token, G expert groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from dsfp4.kernels.backend import upload, use_kernels
from dsfp4.kernels.linear import linear
from dsfp4.kernels.moe.kernel import MoEKernel
from dsfp4.kernels.moe.waves import StepChoices, add_wave, compacts, gains, in_wave, present_pairs, wave_runs
from dsfp4.kernels.router.gate_scores import gate_scores, gate_scores_ref
from dsfp4.kernels.router.route import can_route, chosen_weights, route, route_ref
from dsfp4.kernels.swiglu import swiglu
from dsfp4.layout.model_args import ModelArgs
from dsfp4.runtime.models.weights import Weights
from dsfp4.runtime.store.cache_aware import Swap
from dsfp4.runtime.store.expert_store import ExpertStore
from dsfp4.runtime.store.host_lane import abandoned_on_error
from dsfp4.runtime.store.layer_step import LayerAsk, LayerExperts
from dsfp4.runtime.store.lever_rules import kept_weights

if TYPE_CHECKING:
    from dsfp4.runtime.models.trace_routing import TraceRouting


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


# "greedy" ignores expert groups (V2-Lite)
GROUPED_METHODS = ("noaux_tc", "group_limited_greedy")


class Gate(nn.Module):
    """Scores every expert (sigmoid, softmax or sqrt(softplus), in fp32), keeps the best n_limited_groups groups,
    picks the top K, and weights them by their scores (without the selection bias), renormalized if configured,
    times route_scale. V3: sigmoid + bias, group score = sum of the group's top 2. V2: softmax, group score =
    max. V4: sqrt(softplus) + bias, no groups."""

    def __init__(self, args: ModelArgs, layer: int, w: Weights):
        super().__init__()
        p, self.args = f"layers.{layer}.ffn.gate.", args
        # as transformers
        self.weight = w.plain(p + "weight", (args.n_routed_experts, args.dim), torch.float32)
        has_bias = args.layer_has_gate_bias(layer)
        bias = w.plain(p + "bias", (args.n_routed_experts,), torch.float32) if has_bias else None
        # kept in fp32 from the file: a bf16 round could flip near-tied selections
        self.bias = bias
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
        # one launch on CUDA (kernels/router/route.py)
        select = route if self.kernel else route_ref
        weights, ids = select(
            scores, self.bias, self.groups, a.n_limited_groups, a.n_activated_experts, a.norm_topk_prob, a.route_scale
        )
        return weights, ids, scores

    def swap(self, weights: torch.Tensor, ids: torch.Tensor, scores: torch.Tensor, margin: float) -> Swap:
        """Cache-aware routing's view of this step (runtime/store/cache_aware.py)."""
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


def spans(n: int, piece: int | None) -> list[slice]:
    """[0, n) in runs of at most `piece` (None: one run): a layer-wise pass's group, through kernels whose workspace
    the plan sizes for a chunk."""
    step = max(n if piece is None else piece, 1)
    return [slice(a, min(a + step, n)) for a in range(0, n, step)] or [slice(0, 0)]


def over(parts: list[slice], f: Callable[[slice], torch.Tensor]) -> torch.Tensor:
    """f of each run of tokens, joined along the tokens (one run: f's own tensor)."""
    return f(parts[0]) if len(parts) == 1 else torch.cat([f(s) for s in parts])


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, w: Weights, experts: ExpertStore, kernel: MoEKernel):
        super().__init__()
        self.layer, self.experts, self.kernel, self.n_experts = layer, experts, kernel, args.n_routed_experts
        self.gate = HashGate(args, layer, w) if args.is_hash_layer(layer) else Gate(args, layer, w)
        inter, p = args.n_shared_experts * args.moe_inter_dim, f"layers.{layer}.ffn.shared_experts."
        self.shared_experts = MLP(p, args.dim, inter, w, args.swiglu_limit) if inter else None
        # set by the model: the next MoE layer and its predicted experts from (this layer's residual, tokens)
        self.next_router: tuple[int, Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]] | None = None
        # a RoutingRecorder
        self.observe: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        # routes by a routing trace instead (models/trace_routing.py)
        self.trace: TraceRouting | None = None
        # set while a decode step is captured in pieces (runtime/generate/decode_graph.py): ends the piece before this
        # layer's loads and gives the offsets the next piece's kernel reads once they are done
        self.cut: Callable[[LayerAsk], torch.Tensor] | None = None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
        piece: int | None = None,
    ) -> torch.Tensor:
        """x: [B, T, D] normed input; residual: the stream(s) x came from, for predicting the next layer's
        experts; tokens: [B, T] ids (hash layers route by them); piece: the most tokens a kernel takes at once (a
        layer-wise pass's group: layer_pass.py), None for all."""
        shape, store = x.shape, self.experts
        x = x.view(-1, shape[-1])  # [T, D]
        parts = spans(x.shape[0], piece)
        tokens = None if tokens is None else tokens.reshape(-1)
        # cache-aware routing swaps choices by the router's scores: not a trace's choice, nor a hash layer's table
        margin = store.rules.levers.cache_aware if self.trace is None and isinstance(self.gate, Gate) else 0.0
        weights, indices, scores = self.gate.scored(x, tokens) if margin else (*self.gate(x, tokens), None)
        # the router ran (its cost stays); the trace's choice replaces its own
        if self.trace is not None:
            weights, indices = self.trace.route(self.layer, x.shape[0])
        if self.observe is not None:
            self.observe(self.layer, weights, indices)
        # the shared experts' output goes to the routed kernel, which adds it as it sums each token's experts (on
        # CUDA, up to 16 tokens); streamed waves add it after their sum
        shared = None if self.shared_experts is None else over(parts, lambda s: self.shared_experts(x[s]))
        # nothing to bring in: the kernel finds every record itself, no host sync
        if store.visible:
            offsets = store.reached(self.layer, indices)

            def run(s: slice) -> torch.Tensor:
                return self.kernel(
                    x[s], indices[s], weights[s], store.gpu, offsets, add=None if shared is None else shared[s]
                )

            return over(parts, run).view(shape)
        ask = self._ask(x, weights, indices, scores, margin, residual, tokens)
        # captured: the loads run between this piece and the next, at each replay
        if self.cut is not None:
            return self._captured(ask, x, indices, weights, shared).view(shape)
        return self._streamed(store.step(ask), x, indices, weights, shared, piece).view(shape)

    def _ask(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        indices: torch.Tensor,
        scores: torch.Tensor | None,
        margin: float,
        residual: torch.Tensor | None,
        tokens: torch.Tensor | None,
    ) -> LayerAsk:
        """What this layer step asks the store for: its choice, the next layer's guesses and the levers' inputs."""
        ask, after = [indices.flatten()], None
        if self.next_router is not None and residual is not None:
            # next layer's choice
            ask.append(self.next_router[1](residual, tokens).flatten())
            after = self.next_router[0]
        thresholded = weights if self.experts.rules.levers.expert_threshold > 0 else None
        swap = self.gate.swap(weights, indices, scores, margin) if margin else None
        lane = self.experts.host_inputs(x, weights, captured=self.cut is not None)
        return LayerAsk(self.layer, torch.cat(ask), indices.numel(), after, thresholded, swap, lane)

    def _captured(
        self, ask: LayerAsk, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None
    ) -> torch.Tensor:
        """A captured step's expert kernel, reading the offsets the loads between the pieces leave in place."""
        offsets = self.cut(ask)
        # one token: the expert it leaves out is exactly the one without a slot (offset -1)
        if ask.weights is not None:
            kept = offsets[indices] >= 0
            weights = kept_weights(weights, kept if ask.lane is None else kept | ask.lane.kept[indices])
        # added in x's dtype (eager steps add it in fp32): one rounding apart
        if ask.lane is not None:
            shared = ask.lane.out if shared is None else shared + ask.lane.out
        return self.kernel(x, indices, weights, self.experts.gpu, offsets, add=shared)

    def _streamed(
        self,
        got: LayerExperts,
        x: torch.Tensor,
        indices: torch.Tensor,
        weights: torch.Tensor,
        shared: torch.Tensor | None,
        piece: int | None,
    ) -> torch.Tensor:
        """An eager step's expert kernel over the store's waves (each wave over the tokens `piece` at a time), and the
        host's share added behind them. Above decode's tokens a wave that leaves pairs out takes only its own
        (kernels/moe/waves.py), added to an fp32 sum, where that gives its experts more rows a call (waves.gains)."""
        y, parts, compact = None, spans(x.shape[0], piece), compacts(x.shape[0], piece)
        with abandoned_on_error(got.job):
            weights = got.kept(weights)
            # the choices on the host once a step: the waves' plans then wait for nothing
            step = StepChoices.of(indices.cpu().numpy(), self.n_experts) if compact else None
            # one wave unless slots run short
            for wave, offsets in got.offsets():
                pairs = present_pairs(step, in_wave(wave, offsets.numel())) if compact else None
                runs = None if pairs is None else wave_runs(self.kernel, pairs, parts[0].stop, x.dtype)
                if runs is not None and gains(self.kernel, pairs, runs, parts[0].stop):
                    y = add_wave(self.kernel, x, indices, weights, self.experts.gpu, offsets, pairs, runs, y)
                    continue
                wave = over(parts, lambda s, o=offsets: self.kernel(x[s], indices[s], weights[s], self.experts.gpu, o))
                # several waves add up in fp32: each is rounded once, as one wave would be
                y = wave if y is None else y.float() + wave
        # the host's sum, in fp32 like several waves', copied up behind the waves' kernels
        if got.job is not None:
            y_host = got.job.result()
            y_host = upload(y_host, x.device)
            y = y_host if y is None else y.float() + y_host
        y = y.to(x.dtype)  # [T, D]
        return y if shared is None else y + shared
