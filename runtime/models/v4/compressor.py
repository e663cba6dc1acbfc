"""DeepSeek-V4's KV compressor and lightning indexer (v4-flash-spec d.7, d.8), with their decoding state.

A compressor turns every window of m tokens into one cache entry: per channel, a softmax over the window's
gates (its own projection plus a learned bias per slot) weights the window's values. CSA (overlap) gives each
token two series: entry w gates over 2m slots, window w-1's first halves and window w's second halves. The
entry is normed, and RoPE'd at its window's first position w * m. Entry w exists once token (w + 1) m - 1 has
been seen; query t may use it iff w < (t + 1) // m.

State between calls, all of it indexed by position: the recent tokens' projections (slot p % m of the series
a token's own window pools; CSA's first halves at p % 2m, so window w-1's stay while window w fills) and the
entries. A step at position p writes only p's slots and, once its window is complete, entry p // m, so a call
may continue where the last one stopped, redo its last position (a replayed step the caller discarded) or
start over at position 0. A chunk at host positions compresses the windows it completes; a captured decode
step (a DevicePosition) computes its window's would-be entry every step and keeps it only when complete.
Projections and the gating run in fp32, as in DeepSeek's reference.
Legend: B batch, T new tokens, m ratio, C series per token (2 for CSA), W entry width, E entries, H heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsfp4.kernels.linear import linear
from dsfp4.layout.model_args import ModelArgs
from dsfp4.runtime.models.norm import RMSNorm
from dsfp4.runtime.models.position import DevicePosition, token_positions
from dsfp4.runtime.models.rope import apply_rotary_tail
from dsfp4.runtime.models.weights import Weights


class Compressor(nn.Module):
    def __init__(
        self,
        a: ModelArgs,
        prefix: str,
        w: Weights,
        ratio: int,
        overlap: bool,
        width: int,
        freqs_cis: torch.Tensor,
        max_batch: int,
        max_len: int,
    ):
        """prefix: the compressor's tensors (layers.N.attn.compressor); freqs_cis: [max_len, R/2] of the layer."""
        super().__init__()
        c = 2 if overlap else 1
        self.m, self.overlap, self.width, self.freqs_cis = ratio, overlap, width, freqs_cis
        self.wkv = w.matrix(prefix + ".wkv", (c * width, a.dim))
        self.wgate = w.matrix(prefix + ".wgate", (c * width, a.dim))
        self.ape = w.plain(prefix + ".ape", (ratio, c * width), torch.float32)
        self.norm = RMSNorm(w.plain(prefix + ".norm.weight", (width,), torch.float32), a.norm_eps)
        f32 = dict(dtype=torch.float32, device=w.device)
        self.register_buffer("entries", torch.zeros(max_batch, max_len // ratio, width, dtype=w.dtype, device=w.device))
        # raw projections (ape is added when pooling): the series a token's own window pools (HCA's only one,
        # CSA's second halves) at p % m; CSA's first halves, which the next window pools, at p % 2m
        self.register_buffer("own_kv", torch.zeros(max_batch, ratio, width, **f32))
        self.register_buffer("own_gate", torch.zeros(max_batch, ratio, width, **f32))
        carried = 2 * ratio if overlap else 0
        self.register_buffer("carry_kv", torch.zeros(max_batch, carried, width, **f32))
        self.register_buffer("carry_gate", torch.zeros(max_batch, carried, width, **f32))

    def forward(self, x: torch.Tensor, start_pos: int | DevicePosition) -> torch.Tensor:
        """x: [B, T, D] (the attention's normed input) at start_pos.. -> the entries [B, E, W]: every one so far
        at host positions; at a DevicePosition its span's first span // m rows (the complete ones valid)."""
        # projections and gating in fp32
        xf = x.float()
        kv, gate = linear(xf, self.wkv), linear(xf, self.wgate)  # [B, T, C W]
        if isinstance(start_pos, DevicePosition):
            return self._step(kv, gate, start_pos)
        b, t, _ = x.shape
        m, end = self.m, start_pos + t
        # windows first .. last - 1 are completed here
        first, last = start_pos // m, end // m
        # the rings give the tokens before start_pos (read before this call's go in)
        if last > first:
            own = self._windows(True, first, last, start_pos, kv, gate)
            # CSA: each window also pools the first halves of the window before it
            carried = self._windows(False, first - 1, last - 1, start_pos, kv, gate) if self.overlap else None
            self.entries[:b, first:last] = self._pool(own, carried, torch.arange(first, last, device=x.device))
        self._remember(kv, gate, torch.arange(start_pos, end, device=x.device))
        return self.entries[:b, :last]

    def _step(self, kv: torch.Tensor, gate: torch.Tensor, where: DevicePosition) -> torch.Tensor:
        """One token at a device position (kv, gate: [B, 1, C W]): its slots written, its window's entry
        computed from them and kept only if the token completes the window -> the span's entry rows."""
        # pos: [1]
        b, m, pos = kv.shape[0], self.m, where.pos
        self._remember(kv, gate, pos)
        window = pos // m  # [1]
        # slot j of the own ring holds token w m + j of this window (the slots past pos: the last window's)
        own = (self.own_kv[:b].unsqueeze(1), (self.own_gate[:b] + self._ape(True)).unsqueeze(1))
        carried = None
        if self.overlap:
            # window w - 1's tokens
            slots = ((window - 1) * m + torch.arange(m, device=pos.device)) % (2 * m)
            carry_gate = self.carry_gate[:b].index_select(1, slots) + self._ape(False)
            # none before window 0
            carry_gate = torch.where(window > 0, carry_gate, float("-inf"))
            carried = (self.carry_kv[:b].index_select(1, slots).unsqueeze(1), carry_gate.unsqueeze(1))
        entry = self._pool(own, carried, window)  # [B, 1, W]
        # row w takes the entry once it is complete; the last row stands in past the end (max_len % m != 0)
        row, rows = window.clamp(max=self.entries.shape[1] - 1), self.entries[:b]
        rows.index_copy_(1, row, torch.where((pos + 1) % m == 0, entry, rows.index_select(1, row)))
        return rows[:, : where.span // m]

    def _ape(self, own: bool) -> torch.Tensor:
        """The slot biases [m, W] of a series: the own one (HCA's all, CSA's second halves) or CSA's first halves."""
        if not self.overlap:
            return self.ape
        return self.ape[:, self.width :] if own else self.ape[:, : self.width]

    def _series(self, kv: torch.Tensor, own: bool) -> torch.Tensor:
        """[..., C W] projections -> one series of them [..., W] (as _ape)."""
        if not self.overlap:
            return kv
        return kv[..., self.width :] if own else kv[..., : self.width]

    def _ring(self, own: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A series' remembered projections (values, gates): [B, m, W] own, [B, 2m, W] CSA's first halves."""
        return (self.own_kv, self.own_gate) if own else (self.carry_kv, self.carry_gate)

    def _windows(
        self, own: bool, w0: int, w1: int, start_pos: int, kv: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows w0 .. w1 - 1 of one series, from its ring's tokens before start_pos and this call's kv, gate
        [B, T, C W] -> (values, gates + ape) [B, n, m, W]; window -1 is empty (value 0, gate -inf)."""
        b, m = kv.shape[0], self.m
        ring_kv, ring_gate = self._ring(own)
        old = torch.arange(max(w0, 0) * m, start_pos, device=kv.device) % ring_kv.shape[1]
        # from max(w0, 0) m
        values = torch.cat([ring_kv[:b].index_select(1, old), self._series(kv, own)], dim=1)
        gates = torch.cat([ring_gate[:b].index_select(1, old), self._series(gate, own)], dim=1)
        if w0 < 0:
            values = torch.cat([values.new_zeros(b, m, self.width), values], dim=1)
            gates = torch.cat([gates.new_full((b, m, self.width), float("-inf")), gates], dim=1)
        n = w1 - w0
        return values[:, : n * m].unflatten(1, (n, m)), gates[:, : n * m].unflatten(1, (n, m)) + self._ape(own)

    def _remember(self, kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor) -> None:
        """Keep the projections [B, T, C W] of the tokens at positions [T]: each series' ring takes the last
        ones it holds, at slot p % its size."""
        b = kv.shape[0]
        for own in (True, False) if self.overlap else (True,):
            ring_kv, ring_gate = self._ring(own)
            size = ring_kv.shape[1]
            # the last `size` tokens: distinct slots
            slots = positions[-size:] % size
            ring_kv[:b].index_copy_(1, slots, self._series(kv[:, -size:], own))
            ring_gate[:b].index_copy_(1, slots, self._series(gate[:, -size:], own))

    def _pool(
        self,
        own: tuple[torch.Tensor, torch.Tensor],
        carried: tuple[torch.Tensor, torch.Tensor] | None,
        windows: torch.Tensor,
    ) -> torch.Tensor:
        """Windows' values and gates [B, n, m, W] of their own series (and CSA's carried first halves of the
        window before each) -> their entries [B, n, W], normed and RoPE'd at windows [n] * m."""
        values, gates = own
        # slots: window w-1's first halves, then window w's second halves
        if carried is not None:
            values, gates = torch.cat([carried[0], values], dim=2), torch.cat([carried[1], gates], dim=2)
        pooled = (values * gates.softmax(dim=2)).sum(dim=2)  # [B, n, W], per channel over the slots
        entry = self.norm(pooled.to(self.entries.dtype))
        return apply_rotary_tail(entry.unsqueeze(2), self.freqs_cis.index_select(0, windows * self.m)).squeeze(2)


def visible_entries(positions: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """positions: [T] of the queries -> [T, E] bool: entry w is complete for query t iff w < (t + 1) // m."""
    entry = torch.arange(n_entries, device=positions.device)
    return entry.unsqueeze(0) < ((positions + 1) // ratio).unsqueeze(1)


class Indexer(nn.Module):
    """CSA's lightning indexer: its own CSA compressor at index_head_dim gives keys; queries come from the
    attention's low-rank query q_r; score(t, w) = sum_h weight(t, h) relu(q_{t,h} . k_w) / sqrt(W), weight
    from weights_proj / sqrt(H). Each query keeps its index_topk best complete entries."""

    def __init__(self, a: ModelArgs, layer: int, w: Weights, freqs_cis: torch.Tensor, max_batch: int, max_len: int):
        super().__init__()
        p = f"layers.{layer}.attn.indexer"
        self.m, self.n_heads, self.head_dim, self.topk = (
            a.compress_ratios[layer],
            a.index_n_heads,
            a.index_head_dim,
            a.index_topk,
        )
        self.compressor = Compressor(
            a, p + ".compressor", w, self.m, True, a.index_head_dim, freqs_cis, max_batch, max_len
        )
        self.wq_b = w.matrix(p + ".wq_b", (a.index_n_heads * a.index_head_dim, a.q_lora_rank))
        self.weights_proj = w.matrix(p + ".weights_proj", (a.index_n_heads, a.dim))
        # the CSA layer's: compress base and YaRN
        self.freqs_cis = freqs_cis

    def forward(self, x: torch.Tensor, q_r: torch.Tensor, start_pos: int | DevicePosition) -> torch.Tensor:
        """x: [B, T, D], q_r: [B, T, Q] -> the entries each query attends [B, T, k], -1 where fewer exist (at a
        DevicePosition: among the span's rows)."""
        b, t, _ = x.shape
        keys = self.compressor(x, start_pos)  # [B, E, W]
        positions = token_positions(start_pos, t, x.device)  # [T]
        q = linear(q_r, self.wq_b).view(b, t, self.n_heads, self.head_dim)
        q = apply_rotary_tail(q, self.freqs_cis.index_select(0, positions))  # [B, T, H, W]
        scores = F.relu(torch.einsum("bthw,bew->bthe", q.float(), keys.float())) * self.head_dim**-0.5
        weights = linear(x, self.weights_proj).float() * self.n_heads**-0.5  # [B, T, H]
        index = torch.einsum("bthe,bth->bte", scores, weights)  # [B, T, E]
        complete = visible_entries(positions, keys.shape[1], self.m)  # [T, E]
        index = index.masked_fill(~complete, float("-inf"))
        top = index.topk(min(self.topk, keys.shape[1]), dim=-1).indices  # [B, T, k]
        # a query with fewer than k entries
        picked = complete.unsqueeze(0).expand(b, -1, -1).gather(2, top)
        return torch.where(picked, top, -1)
