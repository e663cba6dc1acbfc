"""DeepSeek-V4's KV compressor and lightning indexer (v4-flash-spec d.7, d.8), with their decoding state.

A compressor turns every window of m tokens into one cache entry: per channel, a softmax over the window's
gates (its own projection plus a learned bias per slot) weights the window's values. CSA (overlap) gives each
token two series: entry w gates over 2m slots, window w-1's first halves and window w's second halves. The
entry is normed, and RoPE'd at its window's first position w * m. Entry w exists once token (w + 1) m - 1 has
been seen; query t may use it iff w < (t + 1) // m.

State between calls: the projections of the tokens past the last complete window, (CSA) the last complete
window's first halves, and the entries so far. A call continues where the last one stopped (or starts over
at position 0), so chunked prefill after position 0 and token-by-token decoding give the entries one
full-sequence pass gives. Projections and the gating run in fp32, as in DeepSeek's reference.
Legend: B batch, T new tokens, m ratio, C series per token (2 for CSA), W entry width, E entries, H heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsfp4.config import ModelArgs
from dsfp4.kernels.linear import linear
from dsfp4.runtime.norm import RMSNorm
from dsfp4.runtime.rope import apply_rotary_tail
from dsfp4.runtime.weights import Weights


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
        self.register_buffer("pending_kv", torch.zeros(max_batch, ratio, c * width, **f32))  # unfinished window
        self.register_buffer("pending_gate", torch.zeros(max_batch, ratio, c * width, **f32))
        prev = ratio if overlap else 0  # CSA: the last window's first halves (HCA keeps none)
        self.register_buffer("prev_kv", torch.zeros(max_batch, prev, width, **f32))
        self.register_buffer("prev_gate", torch.zeros(max_batch, prev, width, **f32))
        self.pos = 0  # tokens seen

    def forward(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        """x: [B, T, D] (the attention's normed input) at start_pos.. -> every entry so far [B, E, W]."""
        assert start_pos in (0, self.pos), "a V4 cache continues where it stopped (the model checks reusable())"
        b, t, _ = x.shape
        m = self.m
        n_old = start_pos % m  # tokens of the unfinished window, projected by earlier calls
        kv = torch.cat([self.pending_kv[:b, :n_old], linear(x.float(), self.wkv)], dim=1)  # [B, n_old + T, C W]
        gate = torch.cat([self.pending_gate[:b, :n_old], linear(x.float(), self.wgate)], dim=1)
        first, n_win = start_pos // m, (n_old + t) // m  # first window completed here, windows completed
        if n_win:
            kv_w = kv[:, : n_win * m].unflatten(1, (n_win, m))  # [B, n_win, m, C W]
            gate_w = gate[:, : n_win * m].unflatten(1, (n_win, m)) + self.ape
            values, gates = self._slots(kv_w, gate_w, first)
            pooled = (values * gates.softmax(dim=2)).sum(dim=2)  # [B, n_win, W], per channel over the slots
            entry = self.norm(pooled.to(self.entries.dtype))
            positions = torch.arange(first, first + n_win, device=x.device) * m  # each window's first token
            entry = apply_rotary_tail(entry.unsqueeze(2), self.freqs_cis[positions]).squeeze(2)
            self.entries[:b, first : first + n_win] = entry
        rest = kv.shape[1] - n_win * m
        self.pending_kv[:b, :rest], self.pending_gate[:b, :rest] = kv[:, n_win * m :], gate[:, n_win * m :]
        self.pos = start_pos + t
        return self.entries[:b, : self.pos // m]

    def _slots(self, kv_w: torch.Tensor, gate_w: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows' values and gates [B, n_win, m, C W] -> the slots each entry pools [B, n_win, S, W]: its own
        window (HCA), or window w-1's first halves then window w's second halves (CSA; none before window 0)."""
        if not self.overlap:
            return kv_w, gate_w
        b, n_win, m, _ = kv_w.shape
        width = self.width
        values = kv_w.new_zeros(b, n_win, 2 * m, width)
        gates = gate_w.new_full((b, n_win, 2 * m, width), float("-inf"))  # an empty slot weighs nothing
        values[:, :, m:], gates[:, :, m:] = kv_w[..., width:], gate_w[..., width:]
        values[:, 1:, :m], gates[:, 1:, :m] = kv_w[:, :-1, :, :width], gate_w[:, :-1, :, :width]
        if first > 0:  # window first-1 was completed by an earlier call
            values[:, 0, :m], gates[:, 0, :m] = self.prev_kv[:b], self.prev_gate[:b]
        self.prev_kv[:b], self.prev_gate[:b] = kv_w[:, -1, :, :width], gate_w[:, -1, :, :width]
        return values, gates


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
        self.freqs_cis = freqs_cis  # the CSA layer's: compress base and YaRN

    def forward(self, x: torch.Tensor, q_r: torch.Tensor, start_pos: int) -> torch.Tensor:
        """x: [B, T, D], q_r: [B, T, Q] -> the entries each query attends [B, T, k], -1 where fewer exist."""
        b, t, _ = x.shape
        keys = self.compressor(x, start_pos)  # [B, E, W]
        positions = torch.arange(start_pos, start_pos + t, device=x.device)
        q = linear(q_r, self.wq_b).view(b, t, self.n_heads, self.head_dim)
        q = apply_rotary_tail(q, self.freqs_cis[positions])  # [B, T, H, W]
        scores = F.relu(torch.einsum("bthw,bew->bthe", q.float(), keys.float())) * self.head_dim**-0.5
        weights = linear(x, self.weights_proj).float() * self.n_heads**-0.5  # [B, T, H]
        index = torch.einsum("bthe,bth->bte", scores, weights)  # [B, T, E]
        complete = visible_entries(positions, keys.shape[1], self.m)  # [T, E]
        index = index.masked_fill(~complete, float("-inf"))
        top = index.topk(min(self.topk, keys.shape[1]), dim=-1).indices  # [B, T, k]
        picked = complete.unsqueeze(0).expand(b, -1, -1).gather(2, top)  # a query with fewer than k entries
        return torch.where(picked, top, -1)
