"""Write a random benchmark model straight into dsfp4 layout v1, at DeepSeek-V3's or V4-Flash's full width.

GPU benchmarks of the expert store need a model with the real dims (V3: 7168-wide, 256 NVFP4 experts of
24.8 MB per MoE layer; V4-Flash: 4096-wide, 256 MXFP4 experts of 13.4 MB in every layer, its config in
synthetic/shapes.py), and no real checkpoint is reachable offline; converting a synthetic HF checkpoint would
cost twice the disk and hours of CPU quantization. This writes the converted layout directly: the same file
names, tensor names, formats, record layout, offsets and sha256s as `dsfp4 convert --fp4`, so `dsfp4
verify`, `dsfp4 inspect` and the runtime take it as they take a converted model.

Values are random but sane: every quantized weight comes from a truncated Gaussian (std 1/sqrt(fan_in),
cut at 6 sigma) quantized by the package's own quantizers. Only a few slabs and expert records are
quantized; the rest are derived from them by XOR-ing sign bits with random masks and rolling rows (with
their scales), which keeps every block scale exact and every value finite, at memcpy speed. Writes stream
(no layer is ever held in RAM), records are hashed as they are written.

(scripts/bench_model.py writes one from the command line.)
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from dsfp4.convert.backbone import backbone_format
from dsfp4.convert.names.family import name_map
from dsfp4.convert.names.rules import AUX, EXPERT, LINEAR, part_name
from dsfp4.convert.source.hf_config import from_hf_config
from dsfp4.layout.atomic import fsync_dir
from dsfp4.layout.formats import FORMATS, component_shapes, get_format
from dsfp4.layout.fp4 import nvfp4_global_scale
from dsfp4.layout.fp8 import FP8_BLOCK
from dsfp4.layout.manifest import BACKBONE_DIR, ExpertFile, FileEntry, Manifest, TensorEntry
from dsfp4.layout.model_args import ModelArgs
from dsfp4.layout.quant import quantize
from dsfp4.layout.record import RecordLayout
from dsfp4.layout.safetensors_file import SafetensorsWriter, pwrite_all, tensor_bytes
from dsfp4.layout.writer import ExpertFileWriter, ModelWriter
from dsfp4.synthetic.hf_v3 import word_corpus, write_tokenizer
from dsfp4.synthetic.hf_v4 import F32_NAMES
from dsfp4.synthetic.releases import RELEASES

# format of backbone matrices -> manifest option
BACKBONES = {"fp8_e4m3_b128": "fp8", "nvfp4": "fp4"}
# expert records quantized for real; the others are derived from them
N_BASE_RECORDS = 4
# elements of one backbone slab (fp32 while quantized)
SLAB_ELEMENTS = 1 << 23
# random bytes the sign masks are cut from
POOL_BYTES = 32 << 20
# Gaussians are cut at 6 sigma, so NVFP4 global scales are known up front
TRUNCATE = 6.0
# Sign bits per stored byte pattern: e2m1 pairs (two nibbles), one-byte floats, little-endian bf16.
SIGN_PATTERNS = {"U8": b"\x88", "F8_E4M3": b"\x80", "BF16": b"\x00\x80", "F32": b"\x00\x00\x00\x80"}
PLAIN_TORCH = {"bf16": torch.bfloat16, "f32": torch.float32}
# plain tensors of fixed value, by name suffix: norm weights and V4's mHC scales 1; router biases, mHC biases
# and V4's attention sinks 0 (so a forward pass starts from the plain residual path)
ONES, ZEROS = ("norm.weight", "_scale"), ("gate.bias", "_base", "attn_sink")


def model_args(
    n_layers: int, n_dense: int, dims: dict | None = None, mtp: bool = False, family: str = "v3"
) -> tuple[dict, ModelArgs]:
    """The HF-style config.json dict (the release's dims, V3's or V4-Flash's, overridden by `dims`) and ModelArgs built
    from it."""
    cfg = RELEASES[family].full_config(n_layers, n_dense, dims, mtp)
    return cfg, from_hf_config(cfg, "bench model config")


def _seed(*parts: object) -> int:
    return zlib.crc32(json.dumps([str(p) for p in parts]).encode())


def _rng(seed: int, *tag: object) -> np.random.Generator:
    return np.random.default_rng([seed, _seed(*tag)])


def _gaussian(rows: int, cols: int, std: float, gen: torch.Generator) -> torch.Tensor:
    """Drawn on the CPU (the same values everywhere), moved to the GPU if there is one: the quantizers give
    the same bytes on either device, much faster on a GPU."""
    w = torch.randn(rows, cols, generator=gen).clamp_(-TRUNCATE, TRUNCATE).mul_(std)
    return w.to("cuda") if torch.cuda.is_available() else w


class SignMasks:
    """XOR masks of random sign bits, cut at random places from one pool of random bytes."""

    def __init__(self, seed: int, nbytes: int = POOL_BYTES):
        self.raw = np.frombuffer(_rng(seed, "sign pool").bytes(nbytes), dtype=np.uint8)
        self.masks: dict[str, np.ndarray] = {}
        self.lock = threading.Lock()

    def _mask(self, dtype: str) -> np.ndarray:
        with self.lock:
            if dtype not in self.masks:
                pattern = np.frombuffer(SIGN_PATTERNS[dtype], dtype=np.uint8)
                self.masks[dtype] = self.raw & np.tile(pattern, self.raw.size // pattern.size)
            return self.masks[dtype]

    def flip(self, out: np.ndarray, dtype: str, rng: np.random.Generator) -> None:
        """Flip random signs of the elements stored in `out` (a contiguous uint8 array), in place."""
        flat, mask = out.reshape(-1), self._mask(dtype)
        step, elem = mask.size // 2, len(SIGN_PATTERNS[dtype])
        for pos in range(0, flat.size, step):
            n = min(step, flat.size - pos)
            off = int(rng.integers(0, step // elem)) * elem
            np.bitwise_xor(flat[pos : pos + n], mask[off : off + n], out=flat[pos : pos + n])


def _u8(t: torch.Tensor) -> np.ndarray:
    """The bytes of t as uint8, one row per row of t (flat for a scalar)."""
    raw = np.frombuffer(tensor_bytes(t), dtype=np.uint8)
    return raw.reshape(t.shape[0], -1) if t.dim() else raw.copy()


def _slab_rows(cols: int) -> int:
    """Rows of one slab: about SLAB_ELEMENTS elements, a multiple of the 128-row FP8 block."""
    return max(FP8_BLOCK, SLAB_ELEMENTS // cols // FP8_BLOCK * FP8_BLOCK)


def quantized_rows(fmt: str, rows: int, cols: int, std: float, gen: torch.Generator) -> list[np.ndarray]:
    """A [rows, cols] truncated Gaussian in `fmt`, as uint8 arrays per component (row-major, 2-D but the
    NVFP4 global scale), quantized a slab of rows at a time. NVFP4 uses amax = 6 std, so every tensor of
    the same std (gate and up of one MLP included, as in NVIDIA's exports) gets the same global scale."""
    slab = _slab_rows(cols)
    amax = torch.tensor(TRUNCATE * std) if fmt == "nvfp4" else None
    chunks = [
        quantize(fmt, _gaussian(min(slab, rows - r), cols, std, gen), "bench", amax) for r in range(0, rows, slab)
    ]
    n_rowwise = len(chunks[0]) - FORMATS[fmt].global_scale
    out = [np.concatenate([_u8(c[i]) for c in chunks]) for i in range(n_rowwise)]
    return out + [_u8(chunks[0][-1])][: FORMATS[fmt].global_scale]


def stored_format(ref: str, kind: str, backbone: str, aux_as_backbone: bool) -> str:
    """The format the converter gives a backbone tensor: matrices DeepSeek ships in FP8 (and, `aux_as_backbone`, the
    other matrices: V3's MTP eh_proj) the backbone format; V4's compressor and indexer matrices (AUX) BF16; the rest
    as the releases store them."""
    if kind == LINEAR or (kind == AUX and aux_as_backbone):
        # a format, or a --backbone spec
        return backbone if backbone in FORMATS else backbone_format(ref, backbone)
    if ref.endswith("tid2eid"):
        return "i64"
    return "f32" if F32_NAMES.fullmatch(ref) else "bf16"


@functools.cache
def backbone_tensors(
    args: ModelArgs, backbone: str, aux_as_backbone: bool
) -> dict[int | None, tuple[tuple[str, str, tuple[int, ...]], ...]]:
    """(ref, format, shape) of every backbone tensor, by block (None: the top file), in the converter's order:
    the family's name map placed for this model, experts left out (stored_format)."""
    out: dict[int | None, list] = {}
    for rule, prefix, block, _, ctx in name_map(args).placed(args, True):
        if rule.kind != EXPERT:
            ref = rule.names(prefix, block)[1]
            fmt = stored_format(ref, rule.kind, backbone, aux_as_backbone)
            out.setdefault(block, []).append((ref, fmt, rule.shape(ctx)))
    return {block: tuple(tensors) for block, tensors in out.items()}


class BackbonePart:
    """One backbone safetensors file of the converter's: its tensors by reference name and format."""

    def __init__(self, args: ModelArgs, block: int | None, backbone: str, aux_as_backbone: bool):
        self.name, self.block, self.args = part_name(block), block, args
        # (ref, format, shape)
        self.tensors = backbone_tensors(args, backbone, aux_as_backbone)[block]

    @property
    def file(self) -> str:
        return f"{BACKBONE_DIR}/{self.name}.safetensors"

    @staticmethod
    def names(ref: str, fmt: str) -> dict[str, str]:
        spec = get_format(fmt)
        return {"weight": ref} if spec.scale is None else {c: f"{ref}.{c}" for c, _ in spec.components}

    def manifest_tensors(self) -> dict[str, TensorEntry]:
        """The manifest's entries of this file's tensors, by reference name."""
        return {ref: TensorEntry(self.file, fmt, shape, self.names(ref, fmt)) for ref, fmt, shape in self.tensors}

    def entries(self) -> list[tuple[str, str, tuple[int, ...]]]:
        out = []
        for ref, fmt, shape in self.tensors:
            spec = FORMATS[fmt]
            shapes = component_shapes(spec, shape, ref)
            names = self.names(ref, fmt)
            out += [(names[c], dt, s) for (c, dt), s in zip(spec.components, shapes, strict=True)]
        return out


class RandomMatrix:
    """A random matrix in `fmt`, produced slab by slab: one slab is generated (and quantized), every slab
    is a copy of it with random signs flipped; scales are copied with their rows, so they stay exact."""

    def __init__(self, ref: str, fmt: str, shape: tuple[int, ...], std: float, seed: int, signs: SignMasks):
        self.ref, self.fmt, self.shape, self.seed, self.signs = ref, fmt, shape, seed, signs
        self.spec = FORMATS[fmt]
        rows, cols = shape
        self.slab = _slab_rows(cols)
        gen = torch.Generator().manual_seed(_seed(seed, ref))
        if self.spec.scale is None:
            self.base = [_u8(_gaussian(min(rows, self.slab), cols, std, gen).to(PLAIN_TORCH[fmt]))]
        else:
            self.base = quantized_rows(fmt, min(rows, self.slab), cols, std, gen)

    def chunks(self, component: str) -> Iterator[np.ndarray]:
        """The stored bytes of one component, in file order."""
        rows = self.shape[0]
        if component == "weight":
            rng, dtype = _rng(self.seed, self.ref, "signs"), self.spec.components[0][1]
            for r0 in range(0, rows, self.slab):
                weight = self.base[0][: min(self.slab, rows - r0)].copy()
                if dtype in SIGN_PATTERNS:
                    self.signs.flip(weight, dtype, rng)
                yield weight
        elif component == "scale":
            # fp8: one scale row per 128 rows; fp4 formats: one per row
            per = self.spec.block[0]
            for r0 in range(0, rows, self.slab):
                yield self.base[1][: -(-min(self.slab, rows - r0) // per)]
        else:
            yield self.base[2]


def write_backbone(out: Path, part: BackbonePart, seed: int, signs: SignMasks) -> FileEntry:
    """One backbone file, written front to back and hashed on the way (no read-back)."""
    path = out / part.file
    tmp = path.with_name(path.name + ".partial")
    sources: dict[str, Callable[[], Iterator[np.ndarray]]] = {}
    for ref, fmt, shape in part.tensors:
        if ref.endswith(ONES + ZEROS):
            value = torch.ones if ref.endswith(ONES) else torch.zeros
            data = _u8(value(shape, dtype=PLAIN_TORCH[fmt]))
            sources[ref] = lambda data=data: iter([data])
        elif ref.endswith("tid2eid"):
            # V4's hash layers: valid, distinct experts per token
            rng = _rng(seed, ref)
            sources[ref] = lambda shape=shape, rng=rng: tid2eid_rows(shape, part.args.n_routed_experts, rng)
        else:
            # embedding at unit scale (a residual stream of rms ~1), projections (mHC's too) at 1/sqrt(fan_in)
            # the MTP layer's too
            std = 1.0 if ref.endswith("embed.weight") else 1.0 / math.sqrt(shape[1])
            m = RandomMatrix(ref, fmt, shape, std, seed, signs)
            for c, name in part.names(ref, fmt).items():
                sources[name] = lambda m=m, c=c: m.chunks(c)
    w = SafetensorsWriter(tmp, part.entries())
    try:
        h = hashlib.sha256(os.pread(w.fd, w.data_start, 0))
        pos = w.data_start
        for name in sorted(w.layout, key=lambda n: w.layout[n][0]):
            if w.span(name)[0] != pos:
                raise AssertionError(f"{tmp}: {name} does not follow the previous tensor")
            for chunk in sources[name]():
                view = memoryview(np.ascontiguousarray(chunk)).cast("B")
                h.update(view)
                pwrite_all(w.fd, view, pos)
                pos += len(view)
            if pos != sum(w.span(name)):
                raise AssertionError(f"{tmp}: {name} got {pos - w.span(name)[0]} bytes, planned {w.span(name)[1]}")
            w.mark_written(name)
        if pos != w.nbytes:
            raise AssertionError(f"{tmp}: wrote {pos} bytes, planned {w.nbytes}")
        w.close()
    except BaseException:
        w.abort()
        raise
    os.replace(tmp, path)
    return FileEntry(pos, h.hexdigest())


class ExpertRecords:
    """Expert records of one model: N_BASE_RECORDS quantized from Gaussians, every other one derived from
    one of them by rolling the rows of w13 and w2 (with their scale rows) and flipping random signs."""

    def __init__(self, layout: RecordLayout, seed: int, signs: SignMasks):
        self.layout, self.seed, self.signs = layout, seed, signs
        d, i = layout.dim, layout.inter_dim
        self.bases = []
        for b in range(N_BASE_RECORDS):
            gen = torch.Generator().manual_seed(_seed(seed, "expert base", b))
            w13 = quantized_rows(layout.format, 2 * i, d, 1.0 / math.sqrt(d), gen)
            w2 = quantized_rows(layout.format, d, i, 1.0 / math.sqrt(i), gen)
            parts = {"w13": w13[0], "w13_scale": w13[1], "w2": w2[0], "w2_scale": w2[1]}
            if layout.format == "nvfp4":
                g13 = nvfp4_global_scale(torch.tensor(TRUNCATE / math.sqrt(d)))
                g2 = nvfp4_global_scale(torch.tensor(TRUNCATE / math.sqrt(i)))
                parts["scale_2"] = _u8(torch.stack([g13, g13, g2])).reshape(-1)
            self.bases.append(parts)
        self.local = threading.local()

    def _view(self, buf: np.ndarray, name: str) -> np.ndarray:
        p = self.layout.part(name)
        region = buf[p.offset : p.offset + p.nbytes]
        return region.reshape(p.shape[0], -1) if len(p.shape) == 2 else region

    def record(self, layer: int, expert: int) -> np.ndarray:
        """The bytes of one record, in a per-thread buffer (valid until this thread's next call)."""
        if getattr(self.local, "buf", None) is None:
            # padding stays zero
            self.local.buf = np.zeros(self.layout.nbytes, dtype=np.uint8)
        buf = self.local.buf
        rng = _rng(self.seed, "expert", layer, expert)
        base = self.bases[int(rng.integers(len(self.bases)))]
        for weight, scale in (("w13", "w13_scale"), ("w2", "w2_scale")):
            n = base[weight].shape[0]
            s = int(rng.integers(n))
            for part in (weight, scale):
                dst, src = self._view(buf, part), base[part]
                dst[: n - s] = src[s:]
                dst[n - s :] = src[:s]
            p = self.layout.part(weight)
            self.signs.flip(buf[p.offset : p.offset + p.nbytes], p.dtype, rng)
        if "scale_2" in base:
            self._view(buf, "scale_2")[:] = base["scale_2"]
        return buf


def write_experts(out: Path, rel: str, layer: int, n_experts: int, records: ExpertRecords, workers: int) -> ExpertFile:
    """One layer file: record e at e * nbytes, each hashed as it is written, made durable and dropped from the
    page cache (the benchmarks read it cold)."""
    w = ExpertFileWriter(out, rel, n_experts, records.layout.nbytes)
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="bench-experts") as pool:
            list(pool.map(lambda e: w.write(e, memoryview(records.record(layer, e))), range(n_experts)))
        return w.finish()
    except BaseException:
        w.abort()
        raise


def write_bench_model(
    out: Path,
    n_layers: int = 6,
    n_dense: int | None = None,
    seed: int = 0,
    dims: dict | None = None,
    backbone: str = "fp8_e4m3_b128",
    with_tokenizer: bool = False,
    mtp: bool = False,
    family: str = "v3",
    expert_format: str | None = None,
) -> Manifest:
    """Write a random model of V3's or (`family` v4) V4-Flash's shape (`dims`: config.json keys overriding the
    real model's) in layout v1 at `out` (which must not exist or be empty): `n_layers` blocks, the first
    `n_dense` (V3 default 1, V4 none) with a dense MLP, experts in `expert_format` (default the family's: V3 NVFP4,
    V4 MXFP4), backbone matrices in `backbone` (fp8_e4m3_b128 or nvfp4). manifest.json is written last."""
    if backbone not in BACKBONES:
        raise ValueError(f"backbone {backbone!r}: choose one of {', '.join(BACKBONES)}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; give a new folder")
    release = RELEASES[family]
    cfg, args = model_args(n_layers, release.bench_dense if n_dense is None else n_dense, dims, mtp, family)
    expert_format = expert_format or args.family_spec.expert_format
    (out / "backbone").mkdir(parents=True, exist_ok=True)
    moe_layers = [b for b in range(args.n_blocks) if args.is_moe_layer(b)]
    record = RecordLayout.for_expert(expert_format, args.dim, args.moe_inter_dim) if moe_layers else None
    if moe_layers:
        (out / "experts").mkdir(exist_ok=True)
    signs = SignMasks(seed)
    workers = max(1, min(8, os.cpu_count() or 1))
    w = ModelWriter(out)
    # quantized while the top is written
    with ThreadPoolExecutor(1, thread_name_prefix="bench-bases") as background:
        records = background.submit(ExpertRecords, record, seed, signs) if record else None
        for block in [None, *range(args.n_blocks)]:
            part = BackbonePart(args, block, backbone, release.aux_as_backbone)
            w.backbone(part.file, write_backbone(out, part, seed, signs), part.manifest_tensors())
            if block is not None and args.is_moe_layer(block):
                rel = f"experts/{part.name}.bin"
                w.expert_file(block, write_experts(out, rel, block, args.n_routed_experts, records.result(), workers))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    aux = ["config.json"]
    if with_tokenizer:
        write_tokenizer(out, args.vocab_size, cfg["model_type"], corpus=word_corpus(args.vocab_size, seed))
        aux += ["tokenizer.json", "tokenizer_config.json"]
    for name in aux:
        w.copied(name)
    fsync_dir(out / "backbone")
    if moe_layers:
        fsync_dir(out / "experts")
    key = json.dumps({"config": cfg, "seed": seed, "backbone": backbone, "generator": "bench_model"}, sort_keys=True)
    source = {
        "fingerprint": hashlib.sha256(key.encode()).hexdigest(),
        "quantization": "synthetic (scripts/bench_model.py)",
        "storage": {},
        "n_tensors": 0,
        "nbytes": 0,
        "n_shards": 0,
        "seed": seed,
    }
    options = {"format": expert_format, "backbone": BACKBONES[backbone], "head": "bf16", "mtp": mtp}
    return w.finish(args, source, options, record)


def bench_model_at(out: Path, **kw: object) -> Manifest:
    """The bench model at `out`: the one a previous run wrote (manifest.json comes last), else a new one
    (write_bench_model's arguments)."""
    if (out / "manifest.json").exists():
        return Manifest.read(out)
    return write_bench_model(out, **kw)


def written_bytes(m: Manifest) -> int:
    records = sum(len(e.offsets) for e in m.experts.values()) * (m.record.nbytes if m.record else 0)
    return sum(f.nbytes for f in m.files.values()) + records


# tokens of a tid2eid table drawn at once (a [rows, n_experts] fp32 draw)
TABLE_ROWS = 8192


def tid2eid_rows(shape: tuple[int, ...], n_experts: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """A hash layer's table [vocab, k] (int64, as the release stores it) in slabs of rows, as the bytes of each
    row: every token gets k distinct experts drawn uniformly (the k smallest of n_experts random keys)."""
    vocab, k = shape
    for r0 in range(0, vocab, TABLE_ROWS):
        keys = rng.random((min(TABLE_ROWS, vocab - r0), n_experts), dtype=np.float32)  # [rows, E]
        ids = np.argpartition(keys, k - 1, axis=1)[:, :k].astype(np.int64)  # [rows, k]
        yield ids.view(np.uint8)
