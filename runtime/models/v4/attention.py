"""DeepSeek-V4 attention: multi-query attention over one shared K=V vector per token (v4-flash-spec d.4-d.9).

Every layer attends a sliding window of its last `window_size` tokens; HCA layers add every complete
compressed entry, CSA layers the entries their lightning indexer picks. One softmax covers window and
entries, with a per-head sink logit in the denominator. The values carry the RoPE'd dims, so the output is
rotated back by -t before the grouped output projection (o_groups blocks of heads, then one mix).

The window's keys sit in a ring of window_size slots, key p at slot p % window_size (as DeepSeek's reference
keeps them), and the compressors' state is indexed by position too: a call continues where the last one
stopped, redoes the last position or starts over at position 0 (chunked prefill and decoding alike), at
positions from the host or, in a captured decode step, at a DevicePosition on the device.
Legend: B batch, T new tokens, S keys (window and entries), H heads, W head_dim, G o_groups, O o_lora_rank.
"""

from __future__ import annotations

import torch
from torch import nn

from dsfp4.kernels.backend import use_kernels
from dsfp4.kernels.fp8.linear import GEMV_MAX_TOKENS
from dsfp4.kernels.linear import QuantizedWeight, linear
from dsfp4.layout.family import CSA, SLIDING
from dsfp4.layout.model_args import ModelArgs
from dsfp4.runtime.models.norm import RMSNorm, rms_normalize
from dsfp4.runtime.models.position import DevicePosition, token_positions
from dsfp4.runtime.models.rope import apply_rotary_tail
from dsfp4.runtime.models.v4.compressor import Compressor, Indexer, visible_entries
from dsfp4.runtime.models.weights import Weights
from dsfp4.runtime.plan.limits import SCORE_ELEMENTS


class AttentionV4(nn.Module):
    def __init__(self, a: ModelArgs, layer: int, w: Weights, freqs_cis: torch.Tensor, max_batch: int, max_len: int):
        """freqs_cis: [max_len, R/2], the layer's rotations (plain for sliding layers, compress + YaRN else)."""
        super().__init__()
        p, hd = f"layers.{layer}.attn.", a.head_dim
        self.n_heads, self.head_dim, self.window, self.groups = a.n_heads, hd, a.window_size, a.o_groups
        self.eps, self.freqs_cis = a.norm_eps, freqs_cis
        self.wq_a = w.matrix(p + "wq_a", (a.q_lora_rank, a.dim))
        self.q_norm = RMSNorm(w.plain(p + "q_norm.weight", (a.q_lora_rank,), torch.float32), a.norm_eps)
        self.wq_b = w.matrix(p + "wq_b", (a.n_heads * hd, a.q_lora_rank))
        self.wkv = w.matrix(p + "wkv", (hd, a.dim))
        self.kv_norm = RMSNorm(w.plain(p + "kv_norm.weight", (hd,), torch.float32), a.norm_eps)
        self.wo_a = w.matrix(p + "wo_a", (a.o_groups * a.o_lora_rank, a.n_heads * hd // a.o_groups))
        self.wo_b = w.matrix(p + "wo_b", (a.dim, a.o_groups * a.o_lora_rank))
        self.sink = w.plain(p + "attn_sink", (a.n_heads,), torch.float32)
        kind, self.ratio = a.layer_kinds[layer], a.compress_ratios[layer]
        self.compressor = (
            Compressor(a, p + "compressor", w, self.ratio, kind == CSA, hd, freqs_cis, max_batch, max_len)
            if kind != SLIDING
            else None
        )
        self.indexer = Indexer(a, layer, w, freqs_cis, max_batch, max_len) if kind == CSA else None
        # window_size slots, one more than a query reads: a token's key replaces the one its own query no longer
        # sees, so the last position can be redone (a replayed step the caller discarded)
        self.register_buffer(
            "window_kv", torch.zeros(max_batch, a.window_size, hd, dtype=w.dtype, device=w.device), persistent=False
        )

    def forward(self, x: torch.Tensor, start_pos: int | DevicePosition) -> torch.Tensor:
        """x: [B, T, D] (attn_norm of the collapsed streams) at positions start_pos.. (or one token at a
        DevicePosition) -> [B, T, D]."""
        b, t, _ = x.shape
        positions = token_positions(start_pos, t, x.device)  # [T]
        freqs = self.freqs_cis.index_select(0, positions)  # [T, R/2]
        q_r = self.q_norm(linear(x, self.wq_a))  # [B, T, Q], the indexer's query input too
        q = rms_normalize(linear(q_r, self.wq_b).view(b, t, self.n_heads, self.head_dim), self.eps)
        q = apply_rotary_tail(q, freqs)  # [B, T, H, W]
        kv = apply_rotary_tail(self.kv_norm(linear(x, self.wkv)).unsqueeze(2), freqs).squeeze(2)  # [B, T, W]
        keys = torch.cat([self.window_kv[:b], kv], dim=1)  # [B, window + T, W]: the ring, then the new keys
        key_pos = torch.cat([ring_positions(positions[:1], self.window), positions])  # [window + T]
        # the window: key s visible to query t iff t - window < s <= t (an empty slot's position is negative)
        since = key_pos.unsqueeze(0) - positions.unsqueeze(1)  # [T, S]
        seen = (since <= 0) & (since > -self.window) & (key_pos >= 0)
        if self.compressor is not None:
            entries = self.compressor(x, start_pos)  # [B, E, W]
            visible = visible_entries(positions, entries.shape[1], self.ratio).unsqueeze(0).expand(b, -1, -1)
            # only the entries the indexer picked (its -1: none)
            if self.indexer is not None:
                top = self.indexer(x, q_r, start_pos)  # [B, T, k]
                picked = torch.zeros(b, t, entries.shape[1] + 1, dtype=torch.bool, device=x.device)
                picked.scatter_(2, torch.where(top < 0, entries.shape[1], top), True)
                visible = visible & picked[..., :-1]
            keys = torch.cat([keys, entries], dim=1)
            seen = torch.cat([seen.unsqueeze(0).expand(b, -1, -1), visible], dim=2)  # [B, T, S]
        else:
            seen = seen.unsqueeze(0).expand(b, -1, -1)
        o = self._attend(q, keys, seen)  # [B, T, H, W]
        self._keep_window(kv, positions)
        # undo the values' rotation at the query's position
        o = apply_rotary_tail(o, freqs.conj())
        o = o.reshape(b, t, self.groups, -1)  # [B, T, G, K]: each group's heads
        z = grouped_output(o, self.wo_a, stored=use_kernels(o) and b * t * self.groups <= GEMV_MAX_TOKENS)
        # z: [B, T, G, O]
        return linear(z.flatten(2), self.wo_b)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """q: [B, T, H, W], keys (= values): [B, S, W], seen: [B, T, S] -> [B, T, H, W]; the sink logit of each
        head joins the softmax's denominator only. Queries go in chunks, so scores stay bounded."""
        b, t, h, _ = q.shape
        step = max(1, SCORE_ELEMENTS // (b * h * keys.shape[1]))
        sink = self.sink.view(1, 1, h, 1)
        out = []
        for t0 in range(0, t, step):
            scores = torch.einsum("bthw,bsw->bths", q[:, t0 : t0 + step].float(), keys.float()) * self.head_dim**-0.5
            scores = scores.masked_fill(~seen[:, t0 : t0 + step].unsqueeze(2), float("-inf"))
            logits = torch.cat([scores, sink.expand(b, scores.shape[1], h, 1)], dim=-1)
            probs = logits.softmax(dim=-1)[..., :-1]  # [B, t, H, S]
            out.append(torch.einsum("bths,bsw->bthw", probs, keys.float()).to(q.dtype))
        return torch.cat(out, dim=1)

    def _keep_window(self, kv: torch.Tensor, positions: torch.Tensor) -> None:
        """kv: [B, T, W], the new keys at positions [T] -> the ring keeps the last window_size, key p at p % size."""
        size = self.window
        self.window_kv[: kv.shape[0]].index_copy_(1, positions[-size:] % size, kv[:, -size:])


def ring_positions(first: torch.Tensor, size: int) -> torch.Tensor:
    """first: [1], the position of a call's first token -> [size]: the position whose key each ring slot holds
    before the call, the last p < first with p % size == slot (negative: none yet)."""
    last = first - 1
    return last - (last - torch.arange(size, device=first.device)).remainder(size)


def grouped_output(o: torch.Tensor, wo_a: QuantizedWeight, stored: bool) -> torch.Tensor:
    """o: [B, T, G, K] -> [B, T, G, O], group g times its block of wo_a [G O, K]. `stored`: one GEMV over
    every group's rows, each group keeping its own block of the output: decode reads wo_a's stored bytes
    once (G times the multiplies, none of the bytes of a dequantized copy). Else wo_a is dequantized once
    for the call and the groups multiply on tensor cores (prefill)."""
    b, t, g, k = o.shape
    if stored:
        y = linear(o.reshape(b * t * g, k), wo_a).view(b * t, g, g, -1)  # [BT, G inputs, G blocks, O]
        # input g with block g
        return y.diagonal(dim1=1, dim2=2).movedim(-1, 1).reshape(b, t, g, -1)
    return torch.einsum("btgk,gok->btgo", o, wo_a.dequantize(o.dtype).view(g, -1, k))
