"""Random expert records in a shuffled slot pool, for the MoE kernel tests."""

from __future__ import annotations

import torch

from dsfp4.layout import fp4
from dsfp4.layout.record import RecordLayout


def random_expert(layout: RecordLayout, gen: torch.Generator) -> bytes:
    """One record of random weights spanning several scale regimes; gate and up get different global
    scales (the record allows it), so a kernel that mixes them up fails."""
    d, i = layout.dim, layout.inter_dim
    w13 = torch.randn(2 * i, d, generator=gen) * torch.logspace(-2, 1, d)[None, :]
    w2 = torch.randn(d, i, generator=gen) * torch.logspace(-2, 1, i)[None, :]
    if layout.format == "nvfp4":
        gate, up, down = (fp4.nvfp4_quantize(w) for w in (w13[:i], 3 * w13[i:], w2))
        parts = {"w13": torch.cat([gate[0], up[0]]), "w13_scale": torch.cat([gate[1], up[1]])}
        parts |= {"w2": down[0], "w2_scale": down[1], "scale_2": torch.stack([gate[2], up[2], down[2]])}
    else:
        (p13, s13), (p2, s2) = fp4.mxfp4_quantize(w13), fp4.mxfp4_quantize(w2)
        parts = {"w13": p13, "w13_scale": s13, "w2": p2, "w2_scale": s2}
    return bytes(layout.pack(parts))


def slot_pool(
    fmt: str, dim: int, inter: int, n_experts: int, gen: torch.Generator, absent: tuple[int, ...] = ()
) -> tuple[RecordLayout, torch.Tensor, torch.Tensor]:
    """(layout, records [S, nbytes] u8 with the experts in shuffled slots and one spare poisoned slot,
    offsets [E] int64 with -1 for the `absent` experts)."""
    layout = RecordLayout.for_expert(fmt, dim, inter)
    slots = torch.randperm(n_experts + 1, generator=gen)[:n_experts]
    records = torch.full((n_experts + 1, layout.nbytes), 0xFF, dtype=torch.uint8)  # 0xFF: NaN scales if read
    for e in range(n_experts):
        records[slots[e]] = torch.frombuffer(bytearray(random_expert(layout, gen)), dtype=torch.uint8)
    offsets = slots.long() * layout.nbytes
    offsets[list(absent)] = -1
    return layout, records, offsets


def routing(t: int, k: int, n_experts: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, K] (distinct per token, shared between tokens) and weights [T, K] fp32."""
    ids = torch.stack([torch.randperm(n_experts, generator=gen)[:k] for _ in range(t)])
    return ids, torch.rand(t, k, generator=gen) + 0.1
