"""DeepSeek-V4 on layout v1: blocks with mHC residual streams, the transformer, the MTP block.

Shares everything but the math with V3 (runtime/models/v3/model.py): weights by name from the manifest, the routed
experts through the ExpertStore and the MoE layer, the engine, server and stats, the decode graphs (a step at
a DevicePosition reads its position on the device). The caches continue where the last call stopped, redo
its last position, or start over at position 0 (`reusable` tells the engine which prefixes it may keep).
Legend: B batch, T tokens, N streams (hc_mult), D dim, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsfp4.kernels.linear import linear
from dsfp4.kernels.moe.kernel import MoEKernel
from dsfp4.layout.family import SLIDING
from dsfp4.layout.model_args import ModelArgs
from dsfp4.runtime.models.moe import HashGate, MoE
from dsfp4.runtime.models.norm import RMSNorm
from dsfp4.runtime.models.position import DevicePosition
from dsfp4.runtime.models.rope import rope_freqs, rotations
from dsfp4.runtime.models.v4.attention import AttentionV4
from dsfp4.runtime.models.v4.mhc import HyperConnection, HyperHead, collapse
from dsfp4.runtime.models.weights import Weights
from dsfp4.runtime.store.expert_store import ExpertStore


class BlockV4(nn.Module):
    # every V4 layer routes experts
    moe = True

    def __init__(
        self,
        a: ModelArgs,
        layer: int,
        w: Weights,
        experts: ExpertStore,
        kernel: MoEKernel | None,
        freqs_cis: torch.Tensor,
        max_batch: int,
        max_len: int,
    ):
        super().__init__()
        p, f32 = f"layers.{layer}.", torch.float32
        self.attn_hc, self.ffn_hc = HyperConnection(a, p + "hc_attn", w), HyperConnection(a, p + "hc_ffn", w)
        self.attn_norm = RMSNorm(w.plain(p + "attn_norm.weight", (a.dim,), f32), a.norm_eps)
        self.attn = AttentionV4(a, layer, w, freqs_cis, max_batch, max_len)
        self.ffn_norm = RMSNorm(w.plain(p + "ffn_norm.weight", (a.dim,), f32), a.norm_eps)
        self.ffn = MoE(a, layer, w, experts, kernel)

    def forward(self, x: torch.Tensor, start_pos: int | DevicePosition, tokens: torch.Tensor) -> torch.Tensor:
        """x: [B, T, N, D] streams, tokens: [B, T] -> the streams after attention and MoE."""
        return self.feed_forward(self.attention(x, start_pos), tokens)

    def attention(self, x: torch.Tensor, start_pos: int | DevicePosition) -> torch.Tensor:
        """The streams x [B, T, N, D] after attention."""
        pre, post, comb = self.attn_hc.weights(x)
        return self.attn_hc.expand(x, self.attn(self.attn_norm(collapse(x, pre)), start_pos), post, comb)

    def feed_forward(self, x: torch.Tensor, tokens: torch.Tensor, piece: int | None = None) -> torch.Tensor:
        """The streams x [B, T, N, D] after the MoE; with `piece` (a layer-wise pass: any tokens, `piece` at a time
        through the kernels) the next layer's experts are not predicted."""
        pre, post, comb = self.ffn_hc.weights(x)
        f = self.ffn(self.ffn_norm(collapse(x, pre)), x if piece is None else None, tokens, piece)
        return self.ffn_hc.expand(x, f, post, comb)

    def route(self, x: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        """The experts this block will pick, predicted from the previous block's streams x [B, T, N, D]: exact
        in a hash layer (tid2eid of the tokens), else its router on ffn_norm of its mHC collapse of x (the
        attention in between is left out)."""
        if isinstance(self.ffn.gate, HashGate):
            return self.ffn.gate.experts_of(tokens)
        u = self.ffn_norm(collapse(x, self.ffn_hc.weights(x)[0]))
        return self.ffn.gate(u.view(-1, u.shape[-1]))[1]


class MTPV4(nn.Module):
    """The multi-token prediction block (v4-flash-spec d.12): the main model's final streams at position i and
    the embedding of token i+1 make its input, one sliding-window V4 block, its own mHC head and norm, the
    shared head; its logits predict token i+2."""

    def __init__(self, a: ModelArgs, layer: int, w: Weights, block: BlockV4, embed: torch.Tensor, head):
        super().__init__()
        p, f32 = f"layers.{layer}.", torch.float32
        self.block, self.embed, self.head = block, embed, head
        self.enorm = RMSNorm(w.plain(p + "enorm.weight", (a.dim,), f32), a.norm_eps)
        self.hnorm = RMSNorm(w.plain(p + "hnorm.weight", (a.dim,), f32), a.norm_eps)
        self.e_proj = w.matrix(p + "e_proj", (a.dim, a.dim))
        self.h_proj = w.matrix(p + "h_proj", (a.dim, a.dim))
        self.hc_head = HyperHead(a, p, w)
        self.norm = RMSNorm(w.plain(p + "norm.weight", (a.dim,), f32), a.norm_eps)

    def forward(self, x: torch.Tensor, next_tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        """x: [B, T, N, D] the main model's final streams, next_tokens: [B, T] -> logits [B, T, V] fp32."""
        e = linear(self.enorm(F.embedding(next_tokens, self.embed)), self.e_proj)  # [B, T, D], every stream's
        u = e.unsqueeze(2) + linear(self.hnorm(x), self.h_proj)  # [B, T, N, D]
        u = self.block(u, start_pos, next_tokens)
        return linear(self.norm(self.hc_head(u)), self.head).float()


class TransformerV4(nn.Module):
    # decode steps can be captured as graphs (runtime/generate/decode_graph.py): at a DevicePosition the window ring,
    # the compressors and RoPE read the position on the device
    why_eager: str | None = None

    def __init__(
        self,
        args: ModelArgs,
        w: Weights,
        experts: ExpertStore,
        max_batch: int,
        max_len: int,
        with_mtp: bool = False,
        prefetch: bool = True,
        fp8_attention: bool = False,
    ):
        super().__init__()
        # the family has no FP8 attention (layout/family.py): run_target refuses the flag before this
        assert not fp8_attention, "DeepSeek-V4's attention has no FP8 variant"
        a = self.args = args
        self.max_len, self.experts = max_len, experts
        # one device: the family does not split (models/families.py)
        self.device, self.cards, self.card_cut = w.device, None, None
        self.embed = w.plain("embed.weight", (a.vocab_size, a.dim))
        layout, k = experts.layout, a.n_activated_experts
        self.moe_kernel = MoEKernel(layout, k, w.device, a.swiglu_limit) if layout else None
        # sliding layers rotate with the plain base; layers with a compressor with its base, YaRN where configured
        main = rotations(rope_freqs(a, a.rope_theta, False), max_len).to(w.device)
        compress = rotations(rope_freqs(a, a.compress_rope_theta, a.rope_type == "yarn"), max_len).to(w.device)
        self.register_buffer("freqs_cis", main, persistent=False)
        self.register_buffer("freqs_compress", compress, persistent=False)

        def block(i: int) -> BlockV4:
            freqs = main if a.layer_kinds[i] == SLIDING else compress
            return BlockV4(a, i, w, experts, self.moe_kernel, freqs, max_batch, max_len)

        self.layers = nn.ModuleList(block(i) for i in range(a.n_layers))
        for here, nxt in zip(self.layers, self.layers[1:], strict=False) if prefetch else ():
            here.ffn.next_router = (nxt.ffn.layer, nxt.route)
        self.hc_head = HyperHead(a, "", w)
        self.norm = RMSNorm(w.plain("norm.weight", (a.dim,), torch.float32), a.norm_eps)
        self.head = w.matrix("head.weight", (a.vocab_size, a.dim))
        mtp = range(a.n_layers, a.n_blocks) if with_mtp else ()
        self.mtp = nn.ModuleList(MTPV4(a, i, w, block(i), self.embed, self.head) for i in mtp)
        # tokens the caches hold (a replayed step: `replayed`)
        self.pos = 0

    def reusable(self, keep: int) -> int:
        """How many of the cached tokens a call may keep when it would keep `keep`: the windows' and
        compressors' state holds only the last positions, so all of them, all but the last (a position's
        step writes only slots that its redo rewrites: a replayed step that the caller discarded leaves the
        caches one past its tokens), or none (none after a call that stopped inside the layers, some of them
        advanced and the others not)."""
        return keep if self.pos - 1 <= keep <= self.pos else 0

    def positional_caches(self, slot: int = 0) -> None:
        """None: the compressed caches and the window ring hold a running state, not rows by position (so no batch
        decodes in slots of its own)."""
        return None

    def replayed(self, pos: int) -> None:
        """A captured step at pos was replayed (its Python did not run): the caches now end after pos."""
        self.pos = pos + 1

    def forward(
        self, tokens: torch.Tensor, start_pos: int | DevicePosition = 0, last_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens: [B, T] at positions start_pos.. (0, or what reusable allows), or one token at a DevicePosition
        (a captured decode step; its replays call `replayed`) -> (logits [B, T or 1, V] fp32, final hidden
        [B, T, D], normed)."""
        h = self.norm(self.hc_head(self.streams(tokens, start_pos)))
        return linear(h[:, -1:] if last_only else h, self.head).float(), h

    def finish(self, x: torch.Tensor, end: int, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The streams [B, T, N, D] after every block (block_ffn) for tokens before position `end` -> (logits [B, T or
        1, V] fp32, final hidden [B, T, D], normed); the caches now end at `end`."""
        self.pos = end
        h = self.norm(self.hc_head(x))
        return linear(h[:, -1:] if last_only else h, self.head).float(), h

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B, T] -> the residual streams entering block 0: the embedding in each, [B, T, N, D]."""
        return F.embedding(tokens, self.embed).unsqueeze(2).expand(-1, -1, self.args.hc_mult, -1).contiguous()

    def block_attention(self, i: int, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Block i's attention on the streams x [B, T, N, D] of tokens at start_pos (0, or where this block's caches
        stopped), as streams() runs it; the model's own position is left invalid."""
        self.pos = -1
        return self.layers[i].attention(x, start_pos)

    def block_ffn(self, i: int, x: torch.Tensor, tokens: torch.Tensor, piece: int) -> torch.Tensor:
        """Block i's MoE on what its attention gave, the streams x [B, T, N, D] of tokens [B, T]."""
        return self.layers[i].feed_forward(x, tokens, piece)

    def streams(self, tokens: torch.Tensor, start_pos: int | DevicePosition = 0) -> torch.Tensor:
        """tokens: [B, T] -> the final residual streams [B, T, N, D] (the MTP block's input)."""
        # nothing on the host: a graph replays this
        if isinstance(start_pos, DevicePosition):
            return self._blocks(tokens, start_pos)
        assert start_pos == 0 or self.reusable(start_pos) == start_pos, "the caches do not hold these positions"
        first = self.layers[0].ffn
        if isinstance(first.gate, HashGate) and not self.experts.visible:
            # layer 0's experts follow from the tokens alone: ask for them before its attention runs
            ids = sorted(set(first.gate.experts_of(tokens).flatten().tolist()))
            self.experts.prefetch(first.layer, ids, protect=set())
        # until every layer has taken the tokens: a pass stopped halfway leaves nothing to continue
        self.pos = -1
        x = self._blocks(tokens, start_pos)
        self.pos = start_pos + tokens.shape[1]
        return x

    def _blocks(self, tokens: torch.Tensor, start_pos: int | DevicePosition) -> torch.Tensor:
        """tokens: [B, T] -> the streams [B, T, N, D] after every block."""
        x = self.embed_tokens(tokens)  # [B, T, N, D]
        for layer in self.layers:
            x = layer(x, start_pos, tokens)
        return x
