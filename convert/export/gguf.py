"""`dsfp4 export MODEL OUT --format gguf`: a converted DeepSeek-V3-family model as one GGUF file that llama.cpp loads
(architecture deepseek2, its MLA graph with the key and value up-projections apart).

What each stored tensor becomes:
  MXFP4 routed experts   GGML MXFP4, each layer's experts stacked per matrix: the same codes and scales, moved
                         (gguf_blocks.py). NVFP4 experts are refused: llama.cpp's DeepSeek graph ignores NVFP4's
                         per-tensor scale, so such a model converts again with --format mxfp4.
  FP8 and NVFP4 matrices Q8_0 (GGUF has no FP8 block type): dequantized, then rounded to 8 bits per 32; the error
                         is measured and reported
  wkv_b                  attn_k_b (each head's key part, transposed) and attn_v_b, in F16, as llama.cpp's graph
                         absorbs them
  norms, router, bias    F32; BF16 tables (embedding, head) as they are
The MTP layer is left out (llama.cpp's DeepSeek graph has none). The tokenizer (byte-level BPE) and the chat template
go in the metadata, and a cold-repacked model's widened records their label (COLD_METADATA, fidelity.py). Every
record is checked against its sha256 on its first read. The file is written tensor by tensor (the peak is one matrix
or one expert record), and a rerun continues after the last tensor written whole. Legend: E experts, N rows, K
columns, H heads.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import version as gguf_version
from pathlib import Path

import numpy as np
import torch
from gguf import ExpertGatingFuncType, GGUFWriter, RopeScalingType, TokenType, quants
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open

from dsfp4.convert.export.fidelity import check_record
from dsfp4.convert.export.gguf_blocks import mxfp4_to_gguf
from dsfp4.convert.transform import ErrorStats as ClassError
from dsfp4.errors import FormatError
from dsfp4.layout.atomic import atomic_write_bytes
from dsfp4.layout.formats import FORMATS
from dsfp4.layout.fp4 import mxfp4_dequantize, mxfp4_quantize
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.model_args import ModelArgs
from dsfp4.layout.quant import dequantize
from dsfp4.layout.safetensors_file import pread_exact
from dsfp4.layout.tokenizer_config import NAME as TOKENIZER_CONFIG
from dsfp4.layout.tokenizer_config import read_tokenizer_config
from dsfp4.version import __version__

ARCH = "deepseek2"
FILE = "model.gguf"
PROGRESS = ".dsfp4-gguf.json"
# the metadata key of the cold records' label (a JSON string)
COLD_METADATA = "dsfp4.cold_records"
# GGUF's default data alignment
ALIGN = 32
TOP = {"embed.weight": "token_embd.weight", "norm.weight": "output_norm.weight", "head.weight": "output.weight"}
# a layer's dsfp4 tensor -> its GGUF name (blk.N. before it); wkv_b splits in two
LAYER = {
    "attn_norm.weight": "attn_norm.weight",
    "attn.wq_a": "attn_q_a.weight",
    "attn.q_norm.weight": "attn_q_a_norm.weight",
    "attn.wq_b": "attn_q_b.weight",
    "attn.wq": "attn_q.weight",
    "attn.wkv_a": "attn_kv_a_mqa.weight",
    "attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "attn.wkv_b": ("attn_k_b.weight", "attn_v_b.weight"),
    "attn.wo": "attn_output.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn.w1": "ffn_gate.weight",
    "ffn.w3": "ffn_up.weight",
    "ffn.w2": "ffn_down.weight",
    "ffn.gate.weight": "ffn_gate_inp.weight",
    "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.shared_experts.w1": "ffn_gate_shexp.weight",
    "ffn.shared_experts.w3": "ffn_up_shexp.weight",
    "ffn.shared_experts.w2": "ffn_down_shexp.weight",
}
GATING = {"softmax": ExpertGatingFuncType.SOFTMAX, "sigmoid": ExpertGatingFuncType.SIGMOID}
EXPERTS = (("w1", "ffn_gate_exps.weight"), ("w3", "ffn_up_exps.weight"), ("w2", "ffn_down_exps.weight"))
# kept in F32
VECTORS = ("norm.weight", "gate.weight", "gate.bias")
# byte-level BPE pre-tokenizers llama.cpp names, told apart by the regexes of tokenizer.json's pre_tokenizer
PRE_TOKENIZERS = (("deepseek-v3", ("\\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+")), ("gpt-2", ()))


@dataclass(frozen=True)
class GTensor:
    """One tensor of the GGUF: its name, its stored bytes' shape ([..., bytes per row]) and type, and its data in
    pieces, in order (`pieces`), each [rows, bytes per row] u8."""

    name: str
    shape: tuple[int, ...]
    qtype: Q
    pieces: Callable[[], Iterator[np.ndarray]]
    # what a requantized tensor is counted as in the error report
    error_class: str | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape))


def _bytes(a: np.ndarray) -> np.ndarray:
    """Any array -> its bytes as [rows, bytes per row] u8 (a vector is one row)."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(-1 if a.ndim > 1 else 1, a.shape[-1] * a.itemsize)


def row_bytes(qtype: Q, k: int) -> int:
    """Bytes of a row of k elements in qtype."""
    block, size = quants.GGML_QUANT_SIZES[qtype]
    return k // block * size


class ErrorStats(dict):
    """The requantization error by class: transform.ErrorStats (the converter's) for each."""

    def add(self, cls: str, ref: np.ndarray, approx: np.ndarray) -> None:
        self.setdefault(cls, ClassError()).add(torch.from_numpy(ref), torch.from_numpy(approx))

    def relative_rms(self) -> dict[str, float]:
        return {c: e.relative_rms for c, e in self.items()}

    def sums(self) -> dict[str, list[float]]:
        """What the progress file keeps of them."""
        return {c: [e.sse, e.ssr] for c, e in self.items()}

    def restore(self, sums: dict[str, list[float]]) -> None:
        self.clear()
        self.update({c: ClassError(*v) for c, v in sums.items()})


class Source:
    """The converted model's tensors as fp32 arrays or stored parts, read as the GGUF's pieces ask for them."""

    def __init__(self, model_dir: Path, manifest: Manifest):
        self.dir, self.m = Path(model_dir), manifest
        self._open: tuple[str, object] | None = None
        # records read whole once, their sha256 checked
        self._checked: set[tuple[int, int]] = set()

    def parts(self, ref: str) -> tuple[torch.Tensor, ...]:
        t = self.m.tensors[ref]
        if self._open is None or self._open[0] != t.file:
            self._open = (t.file, safe_open(self.dir / t.file, framework="pt"))
        return tuple(self._open[1].get_tensor(t.tensors[c]) for c, _ in FORMATS[t.format].components)

    def dense(self, ref: str) -> np.ndarray:
        """The tensor as fp32 (quantized matrices dequantized as dsfp4's runtime reference does)."""
        t = self.m.tensors[ref]
        return dequantize(t.format, self.parts(ref), ref, dtype=torch.float32).numpy()

    def stored(self, layer: int, e: int, which: str) -> tuple[torch.Tensor, ...]:
        """One matrix of expert e's record as stored, its bytes alone read (GGUF puts each expert's gate, up and down
        in three tensors: the record is read once over the three), but for the first: the whole record, its sha256
        checked."""
        # a cold record's codes come widened
        entry, layout = self.m.experts[layer], self.m.layout_of((layer, e))
        path = self.dir / entry.file
        fd = os.open(path, os.O_RDONLY)
        try:
            if (layer, e) not in self._checked:
                raw = check_record(pread_exact(fd, layout.nbytes, entry.offsets[e], path), self.m, self.dir, layer, e)
                self._checked.add((layer, e))
                return layout.stored_from(lambda at, n: raw[at : at + n], which)
            return layout.stored_from(lambda at, n: pread_exact(fd, n, entry.offsets[e] + at, path), which)
        finally:
            os.close(fd)

    def mxfp4(self, layer: int, e: int, which: str, stats: ErrorStats) -> tuple[np.ndarray, np.ndarray]:
        """(packed, scale) of one matrix of expert e (w1, w3 or w2) in MXFP4: as stored, or an NVFP4 one requantized
        (dequantized, then quantized again; the error counted)."""
        parts, layout = self.stored(layer, e, which), self.m.record
        if layout.format == "mxfp4":
            packed, scale = parts
            return packed.view(torch.uint8).numpy(), scale.view(torch.uint8).numpy()
        # fp32
        w = dequantize(layout.format, parts, which)
        packed, scale = mxfp4_quantize(w, which)
        stats.add(f"{layout.format} -> mxfp4 (experts)", w.numpy(), mxfp4_dequantize(packed, scale).numpy())
        return packed.numpy(), scale.numpy()


def check(manifest: Manifest, model_dir: Path, requantize: bool) -> None:
    """One-line refusals for what this GGUF cannot hold."""
    if manifest.record.format != "mxfp4" and not requantize:
        raise FormatError(
            f"{model_dir}: its experts are {manifest.record.format}; llama.cpp's DeepSeek graph ignores NVFP4's "
            f"per-tensor scale: convert with --format mxfp4, or export with --requantize (MXFP4, the error reported)"
        )
    a = manifest.args
    mapped = {n for n in TOP} | {f"layers.{i}.{k}" for i in range(a.n_layers) for k in LAYER}
    unmapped = sorted(n for n in manifest.tensors if n not in mapped and not n.startswith(a.mtp_prefixes))
    if unmapped:
        raise FormatError(f"{model_dir}: {unmapped[0]} has no GGUF name ({len(unmapped)} such); export cannot place it")


def _matrix(src: Source, ref: str, name: str, stats: ErrorStats) -> GTensor:
    """A backbone matrix: BF16 as stored, quantized ones requantized to Q8_0 (error counted)."""
    t = src.m.tensors[ref]
    n, k = t.shape
    if t.format == "bf16":
        return GTensor(name, (n, k * 2), Q.BF16, lambda: iter([_bytes(src.parts(ref)[0].view(torch.int16).numpy())]))

    def pieces() -> Iterator[np.ndarray]:
        w = src.dense(ref)  # [N, K]
        q = quants.quantize(w, Q.Q8_0)
        stats.add(f"{t.format} -> q8_0", w, quants.dequantize(q, Q.Q8_0))
        yield q

    return GTensor(name, (n, row_bytes(Q.Q8_0, k)), Q.Q8_0, pieces, f"{t.format} -> q8_0")


def _vector(src: Source, ref: str, name: str) -> GTensor:
    t = src.m.tensors[ref]
    shape = tuple(t.shape)
    return GTensor(name, (*shape[:-1], shape[-1] * 4), Q.F32, lambda: iter([_bytes(src.dense(ref).astype(np.float32))]))


def _kv_b(src: Source, ref: str, prefix: str, a: ModelArgs) -> list[GTensor]:
    """wkv_b [H (N + V), C] -> attn_k_b [H, C, N] (each head's key rows, transposed) and attn_v_b [H, V, C], F16."""
    h, nope, v, c = a.n_heads, a.qk_nope_head_dim, a.v_head_dim, a.kv_lora_rank

    def part(which: str) -> Iterator[np.ndarray]:
        w = src.dense(ref).reshape(h, nope + v, c)
        out = w[:, :nope].transpose(0, 2, 1) if which == "k" else w[:, nope:]
        yield _bytes(out.astype(np.float16).reshape(-1, out.shape[-1]))

    k_name, v_name = LAYER["attn.wkv_b"]
    return [
        GTensor(prefix + k_name, (h, c, nope * 2), Q.F16, lambda: part("k")),
        GTensor(prefix + v_name, (h, v, c * 2), Q.F16, lambda: part("v")),
    ]


def _experts(src: Source, layer: int, prefix: str, a: ModelArgs, stats: ErrorStats) -> list[GTensor]:
    """Each of a layer's expert matrices stacked [E, N, K/32 * 17] MXFP4, written one expert at a time."""

    def pieces(which: str) -> Iterator[np.ndarray]:
        for e in range(a.n_routed_experts):
            yield mxfp4_to_gguf(*src.mxfp4(layer, e, which, stats))

    shapes = {"w1": (a.moe_inter_dim, a.dim), "w3": (a.moe_inter_dim, a.dim), "w2": (a.dim, a.moe_inter_dim)}
    return [
        GTensor(prefix + name, (a.n_routed_experts, n, row_bytes(Q.MXFP4, k)), Q.MXFP4, lambda w=w: pieces(w))
        for (w, name), (n, k) in ((x, shapes[x[0]]) for x in EXPERTS)
    ]


def plan_tensors(src: Source, stats: ErrorStats) -> list[GTensor]:
    """Every tensor of the GGUF, in the file's order: the top ones, then each layer's."""
    a, m = src.m.args, src.m
    out = []

    def one(ref: str, name: str | tuple[str, str], prefix: str) -> None:
        if isinstance(name, tuple):
            out.extend(_kv_b(src, ref, prefix, a))
        elif ref.endswith(VECTORS) or len(m.tensors[ref].shape) == 1:
            out.append(_vector(src, ref, prefix + name))
        else:
            out.append(_matrix(src, ref, prefix + name, stats))

    for ref, name in TOP.items():
        if ref in m.tensors:
            one(ref, name, "")
    for layer in range(a.n_layers):
        prefix = f"blk.{layer}."
        for key, name in LAYER.items():
            if f"layers.{layer}.{key}" in m.tensors:
                one(f"layers.{layer}.{key}", name, prefix)
        if layer in m.experts:
            out.extend(_experts(src, layer, prefix, a, stats))
    return out


def pre_tokenizer(tok: dict, model_dir: Path) -> str:
    """The name llama.cpp gives tokenizer.json's pre-tokenizer (PRE_TOKENIZERS), or a one-line FormatError."""
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    regexes = [s.get("pattern", {}).get("Regex", "") for s in steps if s.get("type") == "Split"]
    for name, marks in PRE_TOKENIZERS:
        if marks and all(any(mark in r for r in regexes) for mark in marks):
            return name
        if not marks and not regexes and any(s.get("type") == "ByteLevel" and s.get("use_regex", True) for s in steps):
            return name
    raise FormatError(f"{model_dir}/tokenizer.json: a pre-tokenizer llama.cpp does not name; export cannot tag it")


def add_metadata(w: GGUFWriter, a: ModelArgs, model_dir: Path) -> None:
    """Hyperparameters as llama.cpp's deepseek2 loader reads them, then the tokenizer."""
    w.add_block_count(a.n_layers)
    w.add_context_length(a.max_seq_len)
    w.add_embedding_length(a.dim)
    w.add_feed_forward_length(a.inter_dim)
    w.add_head_count(a.n_heads)
    # MLA runs as one shared latent key and value
    w.add_head_count_kv(1)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(a.norm_eps)
    w.add_expert_used_count(a.n_activated_experts)
    w.add_expert_group_count(a.n_expert_groups)
    w.add_expert_group_used_count(a.n_limited_groups)
    w.add_expert_gating_func(GATING[a.score_func])
    w.add_leading_dense_block_count(a.n_dense_layers)
    w.add_vocab_size(a.vocab_size)
    if a.q_lora_rank:
        w.add_q_lora_rank(a.q_lora_rank)
    w.add_kv_lora_rank(a.kv_lora_rank)
    w.add_key_length(a.kv_lora_rank + a.qk_rope_head_dim)
    w.add_value_length(a.kv_lora_rank)
    w.add_key_length_mla(a.qk_nope_head_dim + a.qk_rope_head_dim)
    w.add_value_length_mla(a.v_head_dim)
    w.add_expert_feed_forward_length(a.moe_inter_dim)
    w.add_expert_count(a.n_routed_experts)
    w.add_expert_shared_count(a.n_shared_experts)
    w.add_expert_weights_scale(a.route_scale)
    w.add_expert_weights_norm(a.norm_topk_prob)
    w.add_rope_dimension_count(a.qk_rope_head_dim)
    if a.rope_type == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(a.rope_factor)
        w.add_rope_scaling_orig_ctx_len(a.original_seq_len)
        # llama.cpp's deepseek2 convention
        w.add_rope_scaling_yarn_log_mul(0.1 * a.mscale_all_dim)
        w.add_rope_scaling_yarn_beta_fast(a.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(a.beta_slow)
    add_tokenizer(w, a, model_dir)


def add_tokenizer(w: GGUFWriter, a: ModelArgs, model_dir: Path) -> None:
    """tokenizer.json's vocabulary, merges and special tokens (padded to the model's vocabulary), and the chat
    template of tokenizer_config.json."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FormatError(f"{path} is missing; GGUF carries the tokenizer: copy the source's tokenizer.json there")
    tok = json.loads(path.read_text())
    vocab = dict(tok["model"]["vocab"])
    added = {t["content"]: t for t in tok.get("added_tokens", [])}
    vocab.update({c: t["id"] for c, t in added.items()})
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(a.vocab_size):
        t = by_id.get(i)
        tokens.append(t if t is not None else f"[PAD{i}]")
        if t is None:
            types.append(TokenType.UNUSED)
        elif t in added:
            types.append(TokenType.CONTROL if added[t].get("special") else TokenType.USER_DEFINED)
        else:
            types.append(TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre_tokenizer(tok, model_dir))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if a.bos_token_id is not None:
        w.add_bos_token_id(a.bos_token_id)
    if a.eos_token_ids:
        w.add_eos_token_id(a.eos_token_ids[0])
    cfg = read_tokenizer_config(model_dir / TOKENIZER_CONFIG)
    w.add_add_bos_token(bool(cfg.get("add_bos_token", a.bos_token_id is not None)))
    if isinstance(cfg.get("chat_template"), str):
        w.add_chat_template(cfg["chat_template"])


def header(a: ModelArgs, model_dir: Path, tensors: list[GTensor], cold: dict | None = None) -> bytes:
    """The GGUF's header, metadata and tensor table, as gguf's writer lays them out (a one-line FormatError for a
    tokenizer it cannot carry); `cold`: the label of widened cold records."""
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp) / FILE
        w = GGUFWriter(scratch, ARCH)
        try:
            add_metadata(w, a, model_dir)
            if cold is not None:
                w.add_string(COLD_METADATA, json.dumps(cold))
            for t in tensors:
                w.add_tensor_info(t.name, t.shape, np.dtype(np.uint8), t.nbytes, t.qtype)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
        finally:
            w.close()
        return scratch.read_bytes()


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class GgufPlan:
    """What the export will write: the tensors, the header before them, and where the requantization errors go."""

    tensors: list[GTensor]
    head: bytes
    stats: ErrorStats


def plan(model_dir: Path, manifest: Manifest, requantize: bool = False, cold: dict | None = None) -> GgufPlan:
    """The checks, every tensor of the GGUF and its header (nothing of the weights read yet): anything refused is
    refused before OUT is touched. `requantize`: NVFP4 experts go to MXFP4 (dequantized, then quantized again);
    `cold`: the label of widened cold records, in the metadata."""
    check(manifest, model_dir, requantize)
    stats = ErrorStats()
    tensors = plan_tensors(Source(model_dir, manifest), stats)
    return GgufPlan(tensors, header(manifest.args, model_dir, tensors, cold), stats)


def write(out: Path, manifest: Manifest, p: GgufPlan, bar) -> Path:
    """Write OUT/model.gguf (under .partial until whole). A rerun of the same conversion, header and versions continues
    after the last tensor written whole (PROGRESS records it, with the error sums so far)."""
    tensors, head, stats = p.tensors, p.head, p.stats
    identity = {
        "conversion": manifest.conversion_sha256(),
        "header": hashlib.sha256(head).hexdigest(),
        "versions": [__version__, gguf_version("gguf")],
    }
    path, part, progress_path = out / FILE, out / (FILE + ".partial"), out / PROGRESS
    done = json.loads(progress_path.read_text()) if progress_path.is_file() else {}
    same = done.get("identity") == identity
    if same and done.get("complete") and path.is_file():
        stats.restore(done.get("errors", {}))
        bar.update(sum(t.nbytes for t in tensors))
        return path
    offsets = np.cumsum([_padded(len(head))] + [_padded(t.nbytes) for t in tensors]).tolist()
    start = done.get("tensors", 0) if same and part.is_file() else 0
    # the record ran ahead of the file: begin again
    if start and part.stat().st_size < offsets[start]:
        start = 0
    stats.restore(done.get("errors", {}) if start else {})
    with open(part, "r+b" if start else "wb") as f:
        if start:
            f.truncate(offsets[start])
        else:
            f.write(head + bytes(_padded(len(head)) - len(head)))
        bar.update(sum(t.nbytes for t in tensors[:start]))
        for i in range(start, len(tensors)):
            t, n = tensors[i], 0
            f.seek(offsets[i])
            for piece in t.pieces():
                f.write(piece.tobytes())
                n += piece.nbytes
                bar.update(piece.nbytes)
            if n != t.nbytes:
                raise FormatError(f"{t.name}: wrote {n} bytes, planned {t.nbytes}")
            f.write(bytes(_padded(n) - n))
            f.flush()
            os.fsync(f.fileno())
            record = {"identity": identity, "tensors": i + 1, "errors": stats.sums()}
            atomic_write_bytes(progress_path, json.dumps(record).encode())
    os.replace(part, path)
    atomic_write_bytes(
        progress_path, json.dumps({"identity": identity, "complete": True, "errors": stats.sums()}).encode()
    )
    return path
