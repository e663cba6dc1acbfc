"""`dsfp4 demo`: the whole path on a tiny model, offline. Build a DeepSeek-V3-shaped checkpoint in the
official FP8 layout (or a DeepSeek-V4 one: FP8 backbone with E8M0 scales, MXFP4 experts), convert it to
layout v1, verify it, and answer a prompt with it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dsfp4.convert.pipeline import convert
from dsfp4.convert.plan import ConvertOptions
from dsfp4.layout.verify import verify
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.generate.generation import Generation
from dsfp4.runtime.options import RunOptions
from dsfp4.synthetic.releases import RELEASES
from dsfp4.units import format_bytes

DEMO_PROMPT = "Why does dsfp4 stream experts from the SSD?"
# the tiny model's KV cache: the prompt and a short answer fit
DEMO_CONTEXT = 512


def run_demo(
    workdir: Path,
    prompt: str,
    device: str,
    max_tokens: int,
    echo: Callable[[str], None],
    on_text: Callable[[str], None],
    family: str = "v3",
) -> Generation:
    src, model = Path(workdir) / "hf", Path(workdir) / "model"
    release = RELEASES[family]
    echo(f"1/4 building a tiny {release.tiny_about}, random weights) in {src}")
    release.tiny(src)
    echo(f"2/4 converting it to dsfp4 layout v1 ({release.converted_about}) in {model}")
    result = convert(src, model, ConvertOptions(device=device, force=True), progress=False)
    for klass, err in result.quant_error.items():
        echo(f"    quantization error {klass}: {err:.4g} (relative RMS)")
    echo("3/4 verifying every file and expert record against the manifest")
    report = verify(model)
    echo(f"    OK: {report.n_files} files, {report.n_records} expert records, {format_bytes(report.nbytes)}")
    echo("4/4 answering the prompt (the weights are random, so the answer is gibberish)")
    with Engine(model, RunOptions(device=device, max_context=DEMO_CONTEXT, max_tokens=max_tokens, seed=0)) as engine:
        echo(f"    prompt: {prompt!r} ({len(engine.encode(prompt))} tokens in the model's prompt format)")
        stream = engine.stream(prompt)
        for delta in stream:
            on_text(delta.text)
        return stream.generation
