"""DeepSeek-V3 (and the V2-Lite family) on layout v1: blocks, the transformer, the MTP module.

Names follow DeepSeek's reference inference/model.py. Everything comes from the manifest: the shape
(ModelArgs), every backbone weight by name, the expert records. Legend: B batch, T tokens, D dim, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsfp4.kernels.linear import QuantizedWeight, linear
from dsfp4.kernels.moe.kernel import MoEKernel
from dsfp4.layout.model_args import ModelArgs
from dsfp4.layout.quant import PLAIN_DTYPES
from dsfp4.runtime.models.card_map import CardCut, device_key, split_blocks
from dsfp4.runtime.models.moe import MLP, MoE, over, spans
from dsfp4.runtime.models.norm import RMSNorm
from dsfp4.runtime.models.position import DevicePosition
from dsfp4.runtime.models.rope import precompute_freqs_cis
from dsfp4.runtime.models.v3.attention import MLA, attends_decompressed
from dsfp4.runtime.models.weights import Weights
from dsfp4.runtime.store.expert_store import ExpertStore
from dsfp4.runtime.store.split_store import layer_store

# dtype -> plain format name
PLAIN_FORMATS = {dtype: fmt for fmt, dtype in PLAIN_DTYPES.items()}


class Block(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        layer: int,
        w: Weights,
        experts: ExpertStore,
        kernel: MoEKernel | None,
        max_batch: int,
        max_len: int,
        fp8_attention: bool = False,
    ):
        super().__init__()
        p = f"layers.{layer}."
        # its card's in a split run (runtime/models/card_map.py)
        self.device = w.device_of(p + "attn_norm.weight")
        self.attn_norm = RMSNorm(w.plain(p + "attn_norm.weight", (args.dim,)), args.norm_eps)
        self.attn = MLA(args, layer, w, max_batch, max_len, fp8_attention)
        self.ffn_norm = RMSNorm(w.plain(p + "ffn_norm.weight", (args.dim,)), args.norm_eps)
        self.moe = args.is_moe_layer(layer)
        self.ffn = MoE(args, layer, w, experts, kernel) if self.moe else MLP(p + "ffn.", args.dim, args.inter_dim, w)

    def forward(
        self, x: torch.Tensor, start_pos: int | DevicePosition, freqs_cis: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        x, h = self.ffn_norm.after_add(x, self.attn(self.attn_norm(x), start_pos, freqs_cis, mask))
        return x + (self.ffn(h, x) if self.moe else self.ffn(h))

    def attention(
        self, x: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """forward's first half: x [B, T, D] + its attention."""
        return x + self.attn(self.attn_norm(x), start_pos, freqs_cis, mask)

    def feed_forward(self, x: torch.Tensor, piece: int) -> torch.Tensor:
        """forward's second half on what `attention` gave, x [B, T, D], for any tokens, `piece` at a time through
        the kernels; the next layer's experts are not predicted."""
        h = self.ffn_norm(x)
        if self.moe:
            return x + self.ffn(h, piece=piece)
        flat = h.view(-1, h.shape[-1])  # [B * T, D]
        return x + over(spans(flat.shape[0], piece), lambda s: self.ffn(flat[s])).view_as(x)

    def route(self, h: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The experts this block's router would pick for residual stream h: [B, T, D] -> [B * T, K]. `tokens`
        is unused: the signature is BlockV4.route's, whose hash layers route by token."""
        return self.ffn.gate(self.ffn_norm(h.view(-1, h.shape[-1])))[1]


class MTP(nn.Module):
    """Multi-token prediction module (checkpoint-spec c.9): from the main model's final (normed) hidden
    state at position i and the embedding of token i+1, predict token i+2 with its own decoder block."""

    def __init__(self, args: ModelArgs, layer: int, w: Weights, block: Block):
        """`block`: the module's decoder block (layer `layer`), built like the main model's."""
        super().__init__()
        p, d = f"layers.{layer}.", args.dim
        self.embed = w.plain(p + "embed.weight", (args.vocab_size, d))
        self.enorm = RMSNorm(w.plain(p + "enorm.weight", (d,)), args.norm_eps)
        self.hnorm = RMSNorm(w.plain(p + "hnorm.weight", (d,)), args.norm_eps)
        self.eh_proj = w.matrix(p + "eh_proj", (d, 2 * d))
        self.block = block
        self.head_norm = RMSNorm(w.plain(p + "head_norm.weight", (d,)), args.norm_eps)
        self.head = w.matrix(p + "head.weight", (args.vocab_size, d))

    def forward(
        self,
        h: torch.Tensor,
        next_tokens: torch.Tensor,
        start_pos: int,
        freqs_cis: torch.Tensor,
        mask: torch.Tensor | None,
        last_only: bool = False,
        head: bool = True,
    ) -> torch.Tensor | None:
        """h: [B, T, D] main hidden states, next_tokens: [B, T] -> logits [B, T or 1, V] for the token after
        (None without `head`: only the block's KV cache is filled)."""
        e = F.embedding(next_tokens, self.embed)
        # embedding half first
        u = linear(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1), self.eh_proj)
        u = self.block(u, start_pos, freqs_cis, mask)
        if not head:
            return None
        return linear(self.head_norm(u[:, -1:] if last_only else u), self.head).float()


class Transformer(nn.Module):
    # decode steps can be captured as graphs (runtime/generate/decode_graph.py)
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
        self.args, self.max_len, self.experts = args, max_len, experts
        self.device, self.cards = w.device, w.cards
        # at a cut of a captured step: ends one card's piece and begins the next (runtime/generate/card_graphs.py)
        self.card_cut: CardCut | None = None
        self.embed = w.plain("embed.weight", (args.vocab_size, args.dim))
        layout = experts.layout
        # one a card (a split run's), the first's also the model's
        kernels = [MoEKernel(layout, args.n_activated_experts, d) for d in self._devices()] if layout else [None]
        self.moe_kernel = kernels[0]

        def block(i: int) -> Block:
            card = 0 if self.cards is None else self.cards.card_of[i]
            kernel = kernels[min(card, len(kernels) - 1)]
            return Block(args, i, w, layer_store(experts, i), kernel, max_batch, max_len, fp8_attention)

        self.layers = nn.ModuleList(block(i) for i in range(args.n_layers))
        moe = [b for b in self.layers if b.moe]
        for here, nxt in zip(moe, moe[1:], strict=False) if prefetch else ():
            # predict the next MoE layer's experts
            here.ffn.next_router = (nxt.ffn.layer, nxt.route)
        self.norm = RMSNorm(w.plain("norm.weight", (args.dim,)), args.norm_eps)
        if args.tie_word_embeddings:
            self.head = QuantizedWeight(PLAIN_FORMATS[w.dtype], (self.embed,), tuple(self.embed.shape), "embed.weight")
        else:
            self.head = w.matrix("head.weight", (args.vocab_size, args.dim))
        mtp = range(args.n_layers, args.n_blocks) if with_mtp else ()
        self.mtp = nn.ModuleList(MTP(args, i, w, block(i)) for i in mtp)
        freqs = precompute_freqs_cis(args, max_len)
        self.register_buffer("freqs_cis", freqs.to(w.device), persistent=False)
        # each other card its own tables (by device: the same device named twice reads the same values)
        for c, d in enumerate(self._devices()[1:], 1):
            self.register_buffer(f"freqs_cis_{c}", freqs.to(d), persistent=False)
        self._freqs = {
            device_key(d): getattr(self, f"freqs_cis_{c}" if c else "freqs_cis") for c, d in enumerate(self._devices())
        }

    def _devices(self) -> tuple[torch.device, ...]:
        """The cards of a split run, else the one device."""
        return (self.device,) if self.cards is None else self.cards.cards

    def reusable(self, keep: int) -> int:
        """How many of the cached tokens a call may keep when it would keep `keep`: all of those (the latent
        cache is written by position, so a later call overwrites what follows)."""
        return keep

    def positional_caches(self, slot: int = 0) -> dict[str, torch.Tensor]:
        """Every attention's latent and RoPE caches of one cache slot (the MTP layer's too, when loaded): [max_len, C],
        [max_len, R]. Slot 0 is the one sequence's; a batch decodes in the slots after it."""
        return {n: b[slot] for n, b in self.named_buffers() if n.endswith((".kv_cache", ".pe_cache"))}

    def replayed(self, pos: int) -> None:
        """A captured step at pos was replayed: nothing to move (the latent cache is written by position)."""

    @staticmethod
    def causal_mask(t: int, start_pos: int, device: torch.device) -> torch.Tensor | None:
        """[T, start_pos + T]: token i of this step sees cached positions and new tokens up to itself; None for one
        token, and for a chunk that attends decompressed, causal by position."""
        if t == 1 or attends_decompressed(t):
            return None
        return torch.full((t, start_pos + t), float("-inf"), device=device).triu_(start_pos + 1)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B, T] -> the residual stream entering block 0, [B, T, D]."""
        return F.embedding(tokens, self.embed)

    def block_attention(self, i: int, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Block i's attention on x [B, T, D] (what block i - 1 gave for tokens at start_pos, on block i's device),
        with its residual."""
        freqs, mask = self.positions(x.shape[1], start_pos, x.device)
        return self.layers[i].attention(x, start_pos, freqs, mask)

    def block_ffn(self, i: int, x: torch.Tensor, tokens: torch.Tensor, piece: int) -> torch.Tensor:
        """Block i's feed-forward on what its attention gave, x [B, T, D] (`tokens` is the protocol's: no V3 layer
        routes by token)."""
        return self.layers[i].feed_forward(x, piece)

    def positions(
        self, t: int, start_pos: int | DevicePosition, device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotary frequencies and causal mask for t new tokens at start_pos (for every block), on `device` (a split
        run's card; default the first)."""
        freqs_cis = self._freqs[device_key(device or self.device)]
        # a token per sequence; the span's rows past it are masked out
        if isinstance(start_pos, DevicePosition):
            # pos: [B]
            pos, span = start_pos.pos, start_pos.span
            rows = torch.arange(span, device=freqs_cis.device)
            mask = torch.zeros(len(pos), 1, span, device=rows.device)
            mask.masked_fill_(rows > pos[:, None, None], float("-inf"))  # [B, 1, S]
            return freqs_cis.index_select(0, pos).unsqueeze(1), mask  # [B, 1, R/2], [B, 1, S]
        return freqs_cis[start_pos : start_pos + t], self.causal_mask(t, start_pos, freqs_cis.device)

    def forward(
        self, tokens: torch.Tensor, start_pos: int | DevicePosition = 0, last_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens: [B, T] at positions start_pos.. (or one token at a DevicePosition, as a captured decode step
        does) -> (logits [B, T or 1, V] fp32, final hidden [B, T, D])."""
        h = self.embed_tokens(tokens)  # [B, T, D]
        if self.cards is not None:
            return self.finish(split_blocks(self, h, start_pos), 0, last_only)
        freqs, mask = self.positions(tokens.shape[1], start_pos)
        for layer in self.layers:
            h = layer(h, start_pos, freqs, mask)
        return self.finish(h, 0, last_only)

    def finish(self, h: torch.Tensor, end: int, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """What the last block gave [B, T, D] -> (logits [B, T or 1, V] fp32, final hidden [B, T, D], normed); `end`
        is the protocol's (the latent cache is written by position: nothing to record). A split run's head is on
        its last card."""
        if self.cards is not None:
            h = h.to(self.cards.cards[-1], non_blocking=True)
        h = self.norm(h)
        return linear(h[:, -1:] if last_only else h, self.head).float(), h
