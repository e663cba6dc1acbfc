"""The released models the synthetic ones stand in for, by the name the commands take (`--family v3`, `v4`): the tiny
checkpoint `dsfp4 demo` builds in the release's layout, the config.json its bench model writes at full width (a few
of its layers), and the whole model the projections plan. What their families do is the family tables'
(layout/family.py, convert/family.py, runtime/models/families.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dsfp4.synthetic.hf_v3 import build_synthetic_checkpoint
from dsfp4.synthetic.hf_v4 import build_synthetic_v4_checkpoint
from dsfp4.synthetic.shapes import V3_FULL, V4_FLASH_LAYERS, v3_config, v4_flash_config


@dataclass(frozen=True)
class Release:
    """tiny: writes the tiny checkpoint into a folder; tiny_about, converted_about: the demo's words for it and for
    what conversion makes of it; full_config: (layers, dense layers, dims, mtp) -> config.json at the release's
    width (`dims`: keys over it); bench_dense: a bench model's dense layers when not given; aux_as_backbone: its bench
    model stores AUX matrices in the backbone format, as the LINEAR ones (V3's MTP eh_proj; V4's compressors and
    indexer stay BF16, as its release ships them); whole_layers, whole_dense: the released model's; published_on:
    machines whose published runs of it the projection adds."""

    tiny: Callable[[Path], Path]
    tiny_about: str
    converted_about: str
    full_config: Callable[[int, int, dict | None, bool], dict]
    bench_dense: int
    aux_as_backbone: bool
    whole_layers: int
    whole_dense: int
    published_on: tuple[str, ...] = ()


def _v3_full(n_layers: int, n_dense: int, dims: dict | None, mtp: bool) -> dict:
    cfg = v3_config(
        {**V3_FULL, **(dims or {}), "num_hidden_layers": n_layers, "first_k_dense_replace": n_dense}, "bf16"
    )
    cfg["num_nextn_predict_layers"] = int(mtp)
    return cfg


def _v4_flash(n_layers: int, n_dense: int, dims: dict | None, mtp: bool) -> dict:
    if n_dense:
        raise ValueError("DeepSeek-V4 has no dense layers: give --dense 0")
    return v4_flash_config(n_layers, dims, mtp)


RELEASES: dict[str, Release] = {
    "v3": Release(
        lambda src: build_synthetic_checkpoint(src, variant="fp8"),
        "DeepSeek-V3 checkpoint (official FP8 layout",
        "NVFP4 experts, FP8 backbone",
        _v3_full,
        bench_dense=1,
        aux_as_backbone=True,
        whole_layers=61,
        whole_dense=3,
    ),
    "v4": Release(
        build_synthetic_v4_checkpoint,
        "DeepSeek-V4 checkpoint (official layout: FP8 with E8M0 scales, MXFP4 experts",
        "MXFP4 experts repacked, FP8 backbone",
        _v4_flash,
        # every V4 layer is MoE
        bench_dense=0,
        aux_as_backbone=False,
        whole_layers=V4_FLASH_LAYERS,
        whole_dense=0,
        # its README's V4-Flash decode rates
        published_on=("home-seek",),
    ),
}
