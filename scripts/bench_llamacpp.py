"""llama.cpp beside dsfp4 on the same model: the GGUF `dsfp4 export --format gguf` writes, run by a llama.cpp build.

    python scripts/bench_llamacpp.py check MODEL GGUF --llama-cpp BUILD --llama-src SRC [--prompt TEXT] [--tokens 16]
    python scripts/bench_llamacpp.py bench MODEL GGUF --llama-cpp BUILD [--budget GPU:CPU ...] [--json OUT]

MODEL: a dsfp4 conversion with MXFP4 experts; GGUF: its export; BUILD: llama.cpp's build folder (bin/libllama.so,
bin/llama-bench); SRC: its source (include/llama.h).
`check`: the greedy token ids after one prompt from llama.cpp's library (scripts/llama_greedy.cpp, compiled here) and
from dsfp4 (fp32 on the CPU); where they part, both top-2 logit margins say whether that position is a near-tie (the
GGUF's Q8_0 backbone rounds differently from dsfp4's FP8).
`bench`: llama-bench's prompt and decode tok/s with everything on the GPU (-ngl 99), with the experts on the CPU
(-ot exps=CPU), and CPU only, beside dsfp4's at the budgets given, on the same machine in the same run.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import click
import torch

from dsfp4.runtime.engine import Engine

FILE = click.Path(exists=True, path_type=Path)


def _llama_run(exe: Path, *args: str) -> bytes:
    """A llama.cpp program's stdout, as bytes."""
    out = subprocess.run([str(exe), *args], capture_output=True, timeout=1800)
    if out.returncode != 0:
        tail = out.stderr.decode(errors="replace").strip().splitlines()[-1:]
        raise click.ClickException(f"{exe.name} failed ({out.returncode}): {tail}")
    return out.stdout


def build_greedy(src: Path, build: Path, out: Path) -> Path:
    """scripts/llama_greedy.cpp compiled against llama.cpp's headers (SRC) and libraries (BUILD/bin)."""
    exe, lib = out / "llama_greedy", build / "bin"
    cmd = ["g++", "-O2", "-std=c++17", str(Path(__file__).with_name("llama_greedy.cpp")), "-o", str(exe)]
    cmd += ["-I", str(src / "include"), "-I", str(src / "ggml" / "include"), "-L", str(lib)]
    subprocess.run([*cmd, "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}"], check=True)
    return exe


@click.group()
def main() -> None:
    pass


@main.command()
@click.argument("model", type=FILE)
@click.argument("gguf", type=FILE)
@click.option("--llama-cpp", "build", type=FILE, required=True, help="llama.cpp's build folder (bin/libllama.so)")
@click.option("--llama-src", type=FILE, required=True, help="llama.cpp's source (include/llama.h)")
@click.option("--prompt", default="The expert store keeps the hottest records")
@click.option("--tokens", default=16, show_default=True)
@click.option("--gpu-layers", default=0, show_default=True, help="llama.cpp's -ngl")
def check(model: Path, gguf: Path, build: Path, llama_src: Path, prompt: str, tokens: int, gpu_layers: int) -> None:
    """Greedy token ids of llama.cpp (scripts/llama_greedy.cpp) and dsfp4 (fp32 on the CPU) after one prompt."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_greedy(llama_src, build, Path(tmp))
        with Engine(model, device="cpu", dtype="fp32", max_context=256) as engine:
            ids = engine.tokenizer.encode(prompt)
            text = _llama_run(exe, str(gguf), str(tokens), str(gpu_layers), *map(str, ids))
        theirs = [tuple(line.split()) for line in text.decode().splitlines()]
        with Engine(model, device="cpu", dtype="fp32", max_context=256) as engine:
            ours = engine.generate(ids, max_tokens=tokens, temperature=0).token_ids
            logits = engine.logits(ids + ours)[len(ids) - 1 :]  # [tokens + 1, V]: the logits each token came from
    top2 = torch.topk(logits.float(), 2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    same = 0
    while same < min(len(ours), len(theirs)) and ours[same] == int(theirs[same][0]):
        same += 1
    click.echo(f"dsfp4      {ours}\nllama.cpp  {[int(t[0]) for t in theirs]}")
    click.echo(f"the same for {same} of {len(ours)} tokens")
    if same < min(len(ours), len(theirs)):
        click.echo(
            f"they part at token {same}: dsfp4's top-2 logit margin there {margins[same]:.4f}, llama.cpp's "
            f"{float(theirs[same][1]):.4f} (dsfp4's median margin {sorted(margins)[len(margins) // 2]:.4f})"
        )
    elif len(theirs) != len(ours):
        click.echo(f"llama.cpp gave {len(theirs)} tokens, dsfp4 {len(ours)} (dsfp4 stops at an end-of-sequence token)")


@main.command()
@click.argument("model", type=FILE)
@click.argument("gguf", type=FILE)
@click.option("--llama-cpp", "build", type=FILE, required=True)
@click.option("--prompt-tokens", default=64, show_default=True)
@click.option("--tokens", default=64, show_default=True)
@click.option(
    "--budget", "budgets", multiple=True, help="dsfp4's GPU:CPU budgets, e.g. 60G:40G (repeat; default: free memory)"
)
@click.option(
    "--flash-attn", default="0", show_default=True, help="llama-bench's -fa (0 where its build has no FA kernels)"
)
@click.option("--json", "out", type=click.Path(path_type=Path))
def bench(
    model: Path,
    gguf: Path,
    build: Path,
    prompt_tokens: int,
    tokens: int,
    budgets: tuple[str, ...],
    flash_attn: str,
    out,
) -> None:
    rows = []
    placements = {"all on the GPU": ["-ngl", "99"], "experts on the CPU": ["-ngl", "99", "-ot", "exps=CPU"]}
    placements["CPU only"] = ["-ngl", "0"]
    for name, extra in placements.items():
        args = ("-m", str(gguf), "-p", str(prompt_tokens), "-n", str(tokens), "-fa", flash_attn, "-o", "json", *extra)
        for r in json.loads(_llama_run(build / "bin" / "llama-bench", *args).decode()):
            kind = "prefill" if r.get("n_prompt") else "decode"
            rows.append({"engine": "llama.cpp", "placement": name, "kind": kind, "tok_s": r["avg_ts"]})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for budget in budgets or ("",):
        gpu, _, cpu = budget.partition(":")
        knobs = {"gpu_mem": gpu or None, "cpu_mem": cpu or None}
        with Engine(model, device=device, max_context=prompt_tokens + tokens + 8, **knobs) as e:
            ids = list(range(10, 10 + prompt_tokens))
            e.generate(ids[:8], max_tokens=4, temperature=0)  # warm
            g = e.generate(ids, max_tokens=tokens, temperature=0)
            plan = e.plan
        where = f"{device} {budget or 'free memory'}: {plan.gpu_slots} of {plan.total_records} records on the device"
        rows += [
            {"engine": "dsfp4", "placement": where, "kind": "prefill", "tok_s": g.stats.prefill_tok_s},
            {"engine": "dsfp4", "placement": where, "kind": "decode", "tok_s": g.stats.decode_tok_s},
        ]
    for r in rows:
        click.echo(f"{r['engine']:<10} {r['placement']:<60} {r['kind']:<8} {r['tok_s']:10.1f} tok/s")
    if out:
        out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
