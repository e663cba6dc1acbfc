"""A readable account of a converted model: what is where, in which format, and how big."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from dsfp4.layout.manifest import Manifest
from dsfp4.layout.recipe import describe_bits
from dsfp4.units import format_bytes


def describe(model_dir: Path, tensors: bool = False) -> str:
    m = Manifest.open(Path(model_dir))
    a = m.args
    lines = [
        f"{model_dir}: dsfp4 layout v{m.version} ({m.created_by})",
        f"model   {a.family}: dim {a.dim}, {a.n_layers} layers ({a.n_dense_layers} dense) + {a.n_mtp_layers} MTP, "
        f"{a.n_heads} heads, {a.n_routed_experts} routed experts (top {a.n_activated_experts}), "
        f"vocab {a.vocab_size}",
        f"source  {m.source.get('quantization')} checkpoint, {m.source.get('n_tensors')} tensors, "
        f"{format_bytes(m.source.get('nbytes', 0))}",
        f"options experts {m.options['format']}, backbone {m.options['backbone']}, "
        f"head {m.options.get('head', 'bf16')}, MTP {m.options['mtp']}",
    ]
    by_file: dict[str, Counter] = defaultdict(Counter)
    for t in m.tensors.values():
        by_file[t.file][t.format] += 1
    lines += ["", f"{'file':<40}{'size':>12}  contents"]
    for rel, f in m.files.items():
        kinds = ", ".join(f"{n} {fmt}" for fmt, n in sorted(by_file[rel].items())) or "copied from the source"
        lines.append(f"{rel:<40}{format_bytes(f.nbytes):>12}  {kinds}")
    if m.record:
        n = sum(len(e.offsets) for e in m.experts.values())
        lines += [
            "",
            f"experts {m.record.format}: {n} records of {format_bytes(m.record.nbytes)} in "
            f"{len(m.experts)} layer files, {format_bytes(n * m.record.nbytes)}",
        ]
        lines += [f"  {p.name:<10}{p.dtype:>8} {str(list(p.shape)):<16} offset {p.offset}" for p in m.record.parts]
        if (recipe := m.cold_recipe()) is not None:
            k = sum(len(e.cold) for e in m.experts.values())
            lines.append(
                f"  of which {k} cold, by the cold recipe {recipe}: {m.routed_bits():.2f} bits per routed weight "
                f"as stored, widened to {m.record.format} on their way to the GPU"
            )
        for layer, e in sorted(m.experts.items()):
            cold = ""
            if e.cold:
                c = e.cold_record
                cold = f" ({len(e.cold)} cold: {describe_bits(c.code_bits)}, {c.nbytes / m.record.nbytes:.0%} size)"
            lines.append(f"  layer {layer:>3}: {e.file}, {len(e.offsets)} experts{cold}")
    if m.quant_error:
        lines += ["", "quantization error (relative RMS, ||W - Q(W)|| / ||W||):"]
        lines += [f"  {k:<44}{v:.4g}" for k, v in m.quant_error.items()]
    if m.skipped:
        lines += ["", "skipped source tensors:"] + [f"  {n:>6}  {reason}" for reason, n in m.skipped.items()]
    if tensors:
        lines += ["", f"{'tensor':<44}{'format':<15}{'shape':<18}file"]
        lines += [f"{k:<44}{t.format:<15}{str(list(t.shape)):<18}{t.file}" for k, t in m.tensors.items()]
    return "\n".join(lines)
