"""Load on `dsfp4 run MODEL --serve`: N concurrent streams of chat completions from the official openai client, on
loopback; per concurrency the aggregate decode tok/s and the p50/p99 time to first token and inter-token time, as
the client sees them.

    python scripts/bench_server.py MODEL [--streams 1,2,4,8,16] [--requests 2] [--max-tokens 64] [--passes 2]
                                         [--server-cpus 0-3] [--json OUT] [-- RUN FLAGS...]

Each stream sends --requests requests one after another (streaming, greedy, --max-tokens each, a prompt of its own);
the streams start together. RUN FLAGS go to `dsfp4 run --serve` (e.g. --preset 24g --routing trace.npy). The
server's --max-queue is set to the largest concurrency so that no request is refused. With --server-cpus the server
runs on those cores and the clients on the others, as if they ran on other machines: 16 openai clients parse chunks on
several cores, and on a shared core they slow the server they measure. Where /proc exists each sweep also gives the
CPU the server's two processes used, in cores (the engine's, the HTTP front's): one near 1.0 is what binds.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import httpx
import numpy as np
import openai

TOPICS = ["the sea", "a proof", "an SSD", "a cache", "the moon", "a river", "rust", "a library"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed request -> its times: start, first token, each later token; and the tokens generated."""
    start = time.perf_counter()
    times, usage = [], 0
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return {"start": start, "times": times, "tokens": usage}


def _client_loop(base: str, model: str, i: int, requests: int, max_tokens: int) -> list[dict]:
    """Stream i: its requests one after another."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="bench", max_retries=0, timeout=3600)
    prompts = [f"Write about {TOPICS[(i + r) % len(TOPICS)]}, request {i}.{r}." for r in range(requests)]
    return [_stream(client, model, p, max_tokens) for p in prompts]


def _pin(cpus: set[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


def load(base: str, streams: int, requests: int, max_tokens: int, cpus: set[int] | None = None) -> dict:
    """`streams` clients at once, each `requests` requests in turn -> aggregate tok/s and latency percentiles.

    Each stream is a process of its own, as clients on other machines would be: in one process the openai client's
    parsing (200-400 us of CPU a chunk, under one GIL) bounded the load at a few thousand tokens a second."""
    model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    args = [(base, model, i, requests, max_tokens) for i in range(streams)]
    with multiprocessing.get_context("fork").Pool(streams, _pin, (cpus,)) as pool:  # they start before the clock
        t0 = time.perf_counter()
        results = [r for rs in pool.starmap(_client_loop, args, chunksize=1) for r in rs]  # a failed one raises here
        wall = time.perf_counter() - t0
    ttft = [r["times"][0] - r["start"] for r in results if r["times"]]
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:], strict=False)]
    tokens = sum(r["tokens"] for r in results)

    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) if xs else 0.0

    return {
        "streams": streams,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "aggregate_tok_s": tokens / wall,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p99_s": pct(itl, 99),
    }


def _cpu_s(pid: int) -> float:
    """CPU seconds a process used so far (Linux /proc; 0.0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after the command's name, which may hold spaces
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _with_cpu(pid: int, measure) -> dict:
    """measure() -> its row, with the cores the server (pid) and its HTTP child used while it ran."""
    procs = [pid, *_children(pid)]
    before = [_cpu_s(p) for p in procs]
    row = measure()
    used = [_cpu_s(p) - b for p, b in zip(procs, before, strict=True)]
    row["engine_cores"] = used[0] / row["wall_s"]
    row["http_cores"] = sum(used[1:]) / row["wall_s"]
    return row


def _sweep(
    cmd: list[str],
    log,
    base: str,
    counts: list[int],
    requests: int,
    max_tokens: int,
    passes: int,
    server_cpus: set[int] | None,
) -> list[dict]:
    """Start the server (stderr to `log`), wait for /health, warm it, sweep the concurrencies `passes` times -> each
    sweep's rows."""
    server = subprocess.Popen(cmd, stderr=log, text=True, preexec_fn=lambda: _pin(server_cpus))
    clients = os.sched_getaffinity(0) - server_cpus if server_cpus else None
    try:
        while True:  # the model loads, then the server answers /health
            if server.poll() is not None:
                log.seek(0)
                raise click.ClickException(f"the server exited: {log.read()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        load(base, 1, 1, 8, clients)  # warm: the first request compiles what the engine start did not
        sweep = [lambda n=n: load(base, n, requests, max_tokens, clients) for n in counts]
        sweeps = [[_with_cpu(server.pid, measure) for measure in sweep] for _ in range(passes)]
    finally:
        server.terminate()
        server.wait(timeout=60)
    return sweeps


def _cpus(text: str) -> set[int]:
    """'0-3,6' -> {0, 1, 2, 3, 6}, checked against the cores this process may use."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise click.BadParameter(f"{text!r}: give cores as 0-3 or 0,2", param_hint="--server-cpus") from None
    have = os.sched_getaffinity(0)
    if not cpus or not cpus < have:
        raise click.BadParameter(
            f"{text!r}: name some, not all, of this machine's cores {min(have)}-{max(have)}", param_hint="--server-cpus"
        )
    return cpus


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("model", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--streams", default="1,2,4,8,16", show_default=True)
@click.option("--requests", type=click.IntRange(1), default=2, show_default=True)
@click.option("--max-tokens", type=click.IntRange(1), default=64, show_default=True)
@click.option(
    "--passes",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Sweep the concurrencies this many times and report each sweep (Triton compiles each new prompt length's "
    "kernels once per machine: a later pass measures the server, not the compiler).",
)
@click.option(
    "--server-cpus",
    help="Cores for the server (e.g. 0-3 or 0,2); the clients get the rest. Default: all share every core.",
)
@click.option("--json", "out", type=click.Path(path_type=Path))
@click.argument("run_flags", nargs=-1, type=click.UNPROCESSED)
def main(
    model: Path,
    streams: str,
    requests: int,
    max_tokens: int,
    passes: int,
    server_cpus: str | None,
    out: Path | None,
    run_flags: tuple,
) -> None:
    counts = [int(s) for s in streams.split(",")]
    pinned = _cpus(server_cpus) if server_cpus else None
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "dsfp4.cli.main", "run", str(model), "--serve", "--port", str(port)]
    cmd += ["--max-queue", str(max(counts)), "-q", *run_flags]
    with tempfile.TemporaryFile("w+") as log:  # the server's stderr: a pipe nobody reads would block it once full
        sweeps = _sweep(cmd, log, base, counts, requests, max_tokens, passes, pinned)
    # x1: the aggregate against the same sweep's single stream, where the sweep ran one
    head = ["pass", "streams", "tok/s", "x1", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "cores: engine", "http"]
    widths = [4, 7, 8, 5, 9, 9, 8, 8, 13, 5]
    click.echo(" ".join(f"{h:>{w}}" for h, w in zip(head, widths, strict=True)))
    for i, rows in enumerate(sweeps, 1):
        single = next((r["aggregate_tok_s"] for r in rows if r["streams"] == 1), None)
        for r in rows:
            gain = f"{r['aggregate_tok_s'] / single:5.2f}" if single else f"{'-':>5}"
            click.echo(
                f"{i:4d} {r['streams']:7d} {r['aggregate_tok_s']:8.1f} {gain} {r['ttft_p50_s']:9.3f} "
                f"{r['ttft_p99_s']:9.3f} {r['itl_p50_s'] * 1e3:6.1f}ms {r['itl_p99_s'] * 1e3:6.1f}ms "
                f"{r['engine_cores']:13.2f} {r['http_cores']:5.2f}"
            )
    if out is not None:
        out.write_text(json.dumps({"command": cmd, "server_cpus": server_cpus, "sweeps": sweeps}, indent=1))


if __name__ == "__main__":
    main()
