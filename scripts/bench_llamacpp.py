"""llama.cpp beside dsfp4 on the same model: the GGUF `dsfp4 export --format gguf` writes, run by a llama.cpp build
(mainline, or the ik_llama.cpp fork with --peer ik).

    python scripts/bench_llamacpp.py check MODEL GGUF --llama-cpp BUILD --llama-src SRC [--peer ik] [--prompt TEXT]
        [--tokens 16]
    python scripts/bench_llamacpp.py bench MODEL GGUF --llama-cpp BUILD [--peer ik] [--budget GPU:CPU ...]
        [--placement P ...] [--share 16g] [--reps 5] [--json OUT]

MODEL: a dsfp4 conversion with MXFP4 experts; GGUF: its export (or ik's llama-quantize of it); BUILD: the peer's build
folder (bin/llama-bench; mainline's libraries in bin/, ik's in src/ and ggml/src/); SRC: its source (include/llama.h).
`--peer ik` runs ik_llama.cpp as its users run DeepSeek (-mla 3 -fa 1 -fmoe 1, mmap) and adds the placement
exps-cpu-rtr (experts repacked at load, -rtr, which turns mmap off); its rows say ik_llama.cpp.
`check`: the greedy token ids after one prompt from llama.cpp's library (scripts/llama_greedy.cpp, compiled here) and
from dsfp4 (fp32 on the CPU); where they part, both top-2 logit margins say whether that position is a near-tie (the
GGUF's Q8_0 backbone rounds differently from dsfp4's FP8).
`bench`: llama-bench's prompt and decode tok/s with everything on the GPU (-ngl 99), with the experts on the CPU
(-ot exps=CPU), and CPU only, beside dsfp4's at the budgets given, on the same machine in the same run.
`--share 16g` adds the SSD-bound pair (root, cgroup v1 or v2): dsfp4 with MODEL at the whole DeepSeek-V3's share of
that machine's records on the device and in RAM, and llama.cpp with its experts on the CPU, mmapped, in a memory cgroup
capped at the bytes of dsfp4's RAM tier plus llama.cpp's own memory (measured uncapped). The cgroup charges the page
cache its process faults in, so experts beyond the cap are read from the disk again; GGUF is dropped from the page
cache first. Its rows say the disk bytes read per token and GB/s over the timed runs (/sys/block) and the cgroup's
peak page cache and own memory.
"""

from __future__ import annotations

import bisect
import json
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import torch

from dsfp4.layout.manifest import Manifest
from dsfp4.projection.bench_check import whole_model_share
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.models.load import plan_engine
from dsfp4.runtime.models.moe import Gate, expert_scores
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.plan.planner import Plan
from dsfp4.units import format_bytes

FILE = click.Path(exists=True, path_type=Path)
GREEDY = Path(__file__).with_name("llama_greedy.cpp")


@dataclass(frozen=True)
class Peer:
    """A llama.cpp build as this script drives it: its rows' name, llama-bench's flags for every run (mmap as the load
    mode, the peer's own recipe), the flags that mark each test on stderr and how those lines begin (`progress`: a
    line as each run starts; else one line as each test ends), -fa's default, its placements, its libraries, and
    the environment under which its experts on the CPU stay mmapped (the SSD-bound run and its own memory's
    measurement). The defaults are mainline's (its build of runs 42 and 91 had no flash-attention kernels, hence -fa
    0)."""

    name: str
    flags: tuple[str, ...] = ("-lm", "mmap")
    marks: tuple[str, ...] = ("--progress",)
    mark: str = "llama-bench: benchmark"
    progress: bool = True
    flash_attn: str = "0"
    placements: tuple[str, ...] = ("gpu", "exps-cpu", "cpu")
    lib_dirs: tuple[str, ...] = ("bin",)
    libs: tuple[str, ...] = ("llama", "ggml", "ggml-base")
    defines: tuple[str, ...] = ()
    mapped_env: tuple[tuple[str, str], ...] = ()


PEERS = {
    "llama.cpp": Peer("llama.cpp"),
    # ik's DeepSeek recipe (its llama-bench defaults, said aloud): MLA 3 with flash attention, fused MoE; its
    # llama-bench has no --progress, so each test's CSV line on stderr (-oe csv) marks that test's end
    "ik": Peer(
        "ik_llama.cpp",
        flags=("-mmp", "1", "-mla", "3", "-fmoe", "1"),
        marks=("-oe", "csv"),
        mark='"',
        progress=False,
        flash_attn="1",
        placements=("gpu", "exps-cpu", "exps-cpu-rtr", "cpu"),
        lib_dirs=("src", "ggml/src"),
        libs=("llama", "ggml"),
        defines=("-DIK_LLAMA",),
        # with a CUDA device ik copies tensors placed on the CPU into pinned host memory (CUDA_Host) rather than
        # reading them from the mmapped file, so a model larger than RAM could not stream; this keeps them mapped
        mapped_env=(("GGML_CUDA_NO_PINNED", "1"),),
    ),
}
PEER = click.option(
    "--peer", type=click.Choice(list(PEERS)), default="llama.cpp", show_default=True, help="mainline, or ik_llama.cpp"
)


def _llama_run(exe: Path, *args: str, env: dict[str, str] | None = None) -> bytes:
    """A llama.cpp program's stdout, as bytes (`env`: added to this process's environment)."""
    out = subprocess.run([str(exe), *args], capture_output=True, timeout=1800, env={**os.environ, **(env or {})})
    if out.returncode != 0:
        tail = out.stderr.decode(errors="replace").strip().splitlines()[-1:]
        raise click.ClickException(f"{exe.name} failed ({out.returncode}): {tail}")
    return out.stdout


def greedy_command(src: Path, build: Path, exe: Path, peer: Peer) -> list[str]:
    """The g++ line that compiles scripts/llama_greedy.cpp against the peer's headers (SRC) and libraries (BUILD)."""
    cmd = ["g++", "-O2", "-std=c++17", *peer.defines, str(GREEDY), "-o", str(exe)]
    cmd += ["-I", str(src / "include"), "-I", str(src / "ggml" / "include")]
    for d in (build / d for d in peer.lib_dirs):
        cmd += ["-L", str(d), f"-Wl,-rpath,{d}"]
    return cmd + [f"-l{lib}" for lib in peer.libs]


def build_greedy(src: Path, build: Path, out: Path, peer: Peer) -> Path:
    """scripts/llama_greedy.cpp compiled against the peer's headers and libraries."""
    exe = out / "llama_greedy"
    subprocess.run(greedy_command(src, build, exe, peer), check=True)
    return exe


@click.group()
def main() -> None:
    pass


@main.command()
@click.argument("model", type=FILE)
@click.argument("gguf", type=FILE)
@click.option("--llama-cpp", "build", type=FILE, required=True, help="llama.cpp's build folder (bin/libllama.so)")
@click.option("--llama-src", type=FILE, required=True, help="llama.cpp's source (include/llama.h)")
@PEER
@click.option("--prompt", default="The expert store keeps the hottest records")
@click.option("--tokens", default=16, show_default=True)
@click.option("--gpu-layers", default=0, show_default=True, help="llama.cpp's -ngl")
def check(
    model: Path, gguf: Path, build: Path, llama_src: Path, peer: str, prompt: str, tokens: int, gpu_layers: int
) -> None:
    """Greedy token ids of llama.cpp (scripts/llama_greedy.cpp) and dsfp4 (fp32 on the CPU) after one prompt; then
    llama.cpp's logits along dsfp4's tokens, to tell a parting within the two engines' rounding from one beyond it."""
    name = PEERS[peer].name
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_greedy(llama_src, build, Path(tmp), PEERS[peer])
        with Engine(model, device="cpu", dtype="fp32", max_context=256) as engine:
            ids = engine.tokenizer.encode(prompt)
            ours = engine.generate(ids, max_tokens=tokens, temperature=0).token_ids
            logits = engine.logits(ids + ours)[len(ids) - 1 : len(ids) - 1 + len(ours)]  # [T, V]: each token's
        text = _llama_run(exe, str(gguf), str(tokens), str(gpu_layers), *map(str, ids))
        rows = _llama_run(exe, str(gguf), f"rows:{len(ours) - 1}", str(gpu_layers), *map(str, ids + ours[:-1]))
    theirs = [tuple(line.split()) for line in text.decode().splitlines()]
    top2 = torch.topk(logits.float(), 2, dim=-1)
    margins = (top2.values[:, 0] - top2.values[:, 1]).tolist()
    same = 0
    while same < min(len(ours), len(theirs)) and ours[same] == int(theirs[same][0]):
        same += 1
    click.echo(f"{'dsfp4':<12} {ours}\n{name:<12} {[int(t[0]) for t in theirs]}")
    click.echo(f"the same for {same} of {len(ours)} tokens")
    if same < min(len(ours), len(theirs)):
        click.echo(
            f"they part at token {same}: dsfp4's top-2 logit margin there {margins[same]:.4f}, {name}'s "
            f"{float(theirs[same][1]):.4f} (dsfp4's median margin {sorted(margins)[len(margins) // 2]:.4f})"
        )
    elif len(theirs) != len(ours):
        click.echo(f"{name} gave {len(theirs)} tokens, dsfp4 {len(ours)} (dsfp4 stops at an end-of-sequence token)")
    # along dsfp4's tokens: each row's logit differences, less their mean (a shift of a whole row changes nothing)
    llama = torch.tensor([[float(x) for x in r.split()] for r in rows.decode().splitlines()])  # [T, V]
    delta = llama - logits.float()
    delta -= delta.mean(-1, keepdim=True)
    noise = float(delta.pow(2).mean().sqrt()) * 2**0.5  # of a difference of two logits
    click.echo(f"the engines' logits along dsfp4's tokens: RMS difference of two logits {noise:.4f}")
    if same < len(ours):
        a, b = top2.indices[same].tolist()
        moved = float(delta[same, b] - delta[same, a])
        click.echo(
            f"at token {same} {name}'s rounding moves dsfp4's top two {moved:+.4f} closer, their margin "
            f"{margins[same]:.4f} is {margins[same] / noise:.1f}x that RMS; its narrowest routing decision per MoE "
            f"layer: {[round(m, 4) for m in _router_margins(model, ids + ours[:same])]}"
        )


def _router_margins(model: Path, seq: list[int]) -> list[float]:
    """dsfp4's routing of the last token of `seq`, per MoE layer: the narrowest of its decisions, the weakest kept
    group's score less the best dropped one's (V3: a group scores its top two) and the weakest chosen expert's less
    the best unchosen one's in the kept groups. A near-tie there flips an expert between engines that round
    differently, and with it the layer's output."""
    out: list[float] = []

    def hook(gate: Gate, inputs: tuple, output: tuple) -> None:
        a = gate.args
        score = expert_scores(inputs[0][-1:], gate.weight, a.score_func)[0]  # [E]
        score = score + gate.bias if gate.bias is not None else score
        groups = score.view(gate.groups, -1)  # [G, E / G]
        group_score = groups.topk(min(2, groups.shape[1]), dim=-1).values.sum(-1)  # [G]
        kept = a.n_limited_groups if gate.groups > 1 else 1
        rank = group_score.sort(descending=True).values
        group_margin = float(rank[kept - 1] - rank[kept]) if gate.groups > kept else float("inf")
        chosen = output[1][-1]
        held = group_score.topk(kept).indices
        pool = torch.zeros_like(groups, dtype=torch.bool)
        pool[held] = True
        pool = pool.flatten()
        pool[chosen] = False
        expert_margin = float(score[chosen].min() - score[pool].max()) if pool.any() else float("inf")
        out.append(min(group_margin, expert_margin))

    with Engine(model, device="cpu", dtype="fp32", max_context=256) as engine, torch.inference_mode():
        for m in engine.model.modules():
            if isinstance(m, Gate):
                m.register_forward_hook(hook)
        engine.logits(seq)
    return out


PLACEMENTS = {
    "gpu": ("all on the GPU", ["-ngl", "99"]),
    "exps-cpu": ("experts on the CPU", ["-ngl", "99", "-ot", "exps=CPU"]),
    "cpu": ("CPU only", ["-ngl", "0"]),
    # ik only: the experts repacked into its row-interleaved CPU layouts as they load, which reads them into RAM
    "exps-cpu-rtr": (
        "experts on the CPU, repacked at load (-rtr, no mmap)",
        ["-ngl", "99", "-ot", "exps=CPU", "-rtr", "1"],
    ),
}
CGROUP = Path("/sys/fs/cgroup")
CAP_MARGIN = 256 << 20  # bytes over llama.cpp's measured own memory in its cap, so its peaks are not OOM-killed


@dataclass
class MemoryCgroup:
    """A memory cgroup for llama-bench (cgroup v2, or v1's memory hierarchy). Its limit charges the page cache its
    processes fault in as well as their own memory, so mmapped weights beyond it are read from the disk again."""

    path: Path
    v2: bool

    @classmethod
    def make(cls, name: str = "dsfp4-llama") -> MemoryCgroup:
        """A new cgroup under this process's own (v2: under the root where its own cannot hand memory down)."""
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        own = {controllers: path.lstrip("/") for _, controllers, path in (line.split(":", 2) for line in lines)}
        if not (CGROUP / "cgroup.controllers").is_file():
            path = CGROUP / "memory" / own["memory"] / name
            path.mkdir(exist_ok=True)
            return cls(path, False)
        for parent in (CGROUP / own[""], CGROUP):
            control = parent / "cgroup.subtree_control"
            try:
                if "memory" not in control.read_text().split():
                    control.write_text("+memory")
            except OSError:
                continue
            (parent / name).mkdir(exist_ok=True)
            return cls(parent / name, True)
        raise click.ClickException(f"no cgroup can limit memory here ({CGROUP} is read-only or lacks memory)")

    def limit(self, nbytes: int | None) -> None:
        """Cap the cgroup's memory at nbytes (None: no cap)."""
        name, off = ("memory.max", "max") if self.v2 else ("memory.limit_in_bytes", "-1")
        (self.path / name).write_text(off if nbytes is None else str(nbytes))

    def usage(self) -> tuple[int, int]:
        """(its processes' own memory, page cache) charged to the cgroup now, in bytes."""
        stat = dict(line.split() for line in (self.path / "memory.stat").read_text().splitlines())
        anon, cache = ("anon", "file") if self.v2 else ("rss", "cache")
        return int(stat[anon]), int(stat[cache])

    def wrap(self, cmd: list[str]) -> list[str]:
        """cmd, started inside the cgroup."""
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh", *cmd]


def disk_read_bytes() -> int:
    """Bytes read so far from this machine's disks (loop, RAM and device-mapper devices left out)."""
    skip = ("loop", "ram", "zram", "dm-", "md", "sr")
    disks = [d for d in Path("/sys/block").iterdir() if not d.name.startswith(skip)]
    return sum(int((d / "stat").read_text().split()[2]) * 512 for d in disks)


def evict(path: Path) -> None:
    """Drop a file's pages from the page cache, so that the next reader gets them from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@dataclass
class Watched:
    """A llama-bench run watched: its stdout, its marking lines (label, seconds, disk bytes read so far, then
    "exit"), the disk's count at each poll (seconds, bytes), and the peaks of its cgroup's own memory and page
    cache."""

    stdout: bytes
    events: list[tuple[str, float, int]]
    disk: list[tuple[float, int]] = field(default_factory=list)
    peak_anon: int = 0
    peak_cache: int = 0

    def timed_reads(self, kind: str) -> tuple[int, float]:
        """Disk bytes and seconds of the timed runs of one kind ("prompt" or "generation"): from the progress line of
        its first run to the line (or the exit) after its last."""
        runs = [i for i, e in enumerate(self.events) if f"{kind} run" in e[0] and "warmup" not in e[0]]
        (_, t0, d0), (_, t1, d1) = self.events[runs[0]], self.events[runs[-1] + 1]
        return d1 - d0, t1 - t0

    def disk_at(self, t: float) -> float:
        """Disk bytes read by `t` seconds, interpolated between the polls and the marking lines."""
        points = sorted(self.disk + [(e[1], e[2]) for e in self.events])
        i = bisect.bisect_left(points, (t,))
        if i in (0, len(points)):
            return points[min(i, len(points) - 1)][1]
        (ta, da), (tb, db) = points[i - 1], points[i]
        return da + (db - da) * (t - ta) / (tb - ta)

    def test_reads(self, index: int, seconds: float) -> tuple[int, float]:
        """Disk bytes and seconds of one test's timed runs where only the test's end is marked (ik_llama.cpp: its CSV
        line): the `seconds` its samples took, back from that line (its warm-up and context set-up left out)."""
        _, t1, d1 = self.events[index]
        return round(d1 - self.disk_at(t1 - seconds)), seconds


def run_watched(cmd: list[str], cgroup: MemoryCgroup, mark: str, env: dict[str, str] | None = None) -> Watched:
    """Run llama-bench (with its marking flags) inside the cgroup (`env` added to the environment), noting the
    disk's reads at each stderr line that begins with `mark`, and the disk's reads and the cgroup's peak usage every
    0.1 s."""
    with tempfile.TemporaryFile() as out:
        environ = {**os.environ, **(env or {})}
        proc = subprocess.Popen(cgroup.wrap(cmd), stdout=out, stderr=subprocess.PIPE, text=True, env=environ)
        watched, start, tail = Watched(b"", []), time.monotonic(), []

        def progress() -> None:
            for line in proc.stderr:
                tail[:] = [line.strip()]
                if line.startswith(mark):
                    watched.events.append((line.strip(), time.monotonic() - start, disk_read_bytes()))

        reader = threading.Thread(target=progress)
        reader.start()
        while proc.poll() is None:
            anon, cache = cgroup.usage()
            watched.peak_anon, watched.peak_cache = max(watched.peak_anon, anon), max(watched.peak_cache, cache)
            watched.disk.append((time.monotonic() - start, disk_read_bytes()))
            time.sleep(0.1)
        reader.join()
        watched.events.append(("exit", time.monotonic() - start, disk_read_bytes()))
        if proc.returncode != 0:
            raise click.ClickException(f"llama-bench failed ({proc.returncode}): {tail}")
        out.seek(0)
        watched.stdout = out.read()
    return watched


def llama_rows(
    build: Path, args: list[str], name: str, cgroup: MemoryCgroup | None, ram: str, peer: Peer, mapped: bool = False
) -> tuple[list, int]:
    """llama-bench's prefill and decode rows for one placement (and its peak own memory, where it ran in a cgroup);
    `mapped`: under the peer's environment that keeps its experts mmapped."""
    exe = build / "bin" / "llama-bench"
    env = dict(peer.mapped_env) if mapped else None
    if cgroup is None:
        results, watched = json.loads(_llama_run(exe, *args, env=env).decode()), None
    else:
        watched = run_watched([str(exe), *args, *peer.marks], cgroup, peer.mark, env)
        results = json.loads(watched.stdout.decode())
    rows = []
    for i, r in enumerate(results):
        kind = "prefill" if r.get("n_prompt") else "decode"
        row = {"engine": peer.name, "placement": name, "ram": ram, "kind": kind, "tok_s": r["avg_ts"]}
        if watched is not None:
            if peer.progress:
                nbytes, seconds = watched.timed_reads("prompt" if kind == "prefill" else "generation")
            else:
                nbytes, seconds = watched.test_reads(i, sum(r["samples_ns"]) / 1e9)
            tokens = (r["n_prompt"] or r["n_gen"]) * len(r["samples_ts"])
            row |= {"disk_gb_per_token": nbytes / tokens / 1e9, "disk_gb_s": nbytes / seconds / 1e9}
            row |= {"peak_cache_gb": watched.peak_cache / 1e9, "peak_own_gb": watched.peak_anon / 1e9}
        rows.append(row)
    return rows, watched.peak_anon if watched else 0


def dsfp4_rows(model: Path, options: RunOptions, plan: Plan | None, where: str, prompt_tokens: int, tokens: int):
    """dsfp4's prefill and decode rows, after a warm-up prompt of the same length (Triton compiles per length)."""
    with Engine(model, options, plan=plan) as e:
        e.tokenizer.eos_ids = frozenset()  # every answer runs to its max_tokens
        e.generate(list(range(1000, 1000 + prompt_tokens)), max_tokens=4, temperature=0)  # warm
        g = e.generate(list(range(10, 10 + prompt_tokens)), max_tokens=tokens, temperature=0)
        plan = e.plan
    ram = f"{plan.ram_slots} of {plan.total_records} records in RAM"
    placement = f"{where}: {plan.gpu_slots} of {plan.total_records} records on the device"
    stats = g.stats.to_dict()  # the store's SSD bytes are counted over the prompt and the decode together
    extra = {"ssd_gb_per_token_of_both": stats["ssd_bytes_per_token"] / 1e9, "ssd_read_gb_s": stats["ssd_read_gb_s"]}
    extra["ram_hit_rate"] = stats["ram_hit_rate"]
    return [
        {"engine": "dsfp4", "placement": placement, "ram": ram, "kind": "prefill", "tok_s": g.stats.prefill_tok_s},
        {"engine": "dsfp4", "placement": placement, "ram": ram, "kind": "decode", "tok_s": g.stats.decode_tok_s}
        | extra,
    ]


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
    "--placement",
    "placements",
    multiple=True,
    type=click.Choice(list(PLACEMENTS)),
    help="llama-bench's placements (repeat; default: all the peer's: exps-cpu-rtr is ik's alone)",
)
@click.option(
    "--share",
    type=click.Choice(["16g", "24g"]),
    help="also the SSD-bound pair: dsfp4 at the whole V3's share of that machine, llama.cpp (experts on the CPU, "
    "mmapped) in a memory cgroup capped at the same RAM bytes plus its own memory measured uncapped (root)",
)
@click.option("--reps", default=5, show_default=True, help="llama-bench's -r")
@click.option("--flash-attn", help="llama-bench's -fa (default: llama.cpp 0, for a build without FA kernels; ik 1)")
@PEER
@click.option("--json", "out", type=click.Path(path_type=Path))
def bench(
    model: Path,
    gguf: Path,
    build: Path,
    prompt_tokens: int,
    tokens: int,
    budgets: tuple[str, ...],
    placements: tuple[str, ...],
    share: str | None,
    reps: int,
    flash_attn: str | None,
    peer: str,
    out: Path | None,
) -> None:
    """llama-bench beside dsfp4 at the same prompt and decode lengths; with --share, also where RAM is short."""
    p = PEERS[peer]
    if alien := [k for k in placements if k not in p.placements]:
        raise click.UsageError(
            f"--placement {alien[0]}: {p.name} has no such placement (it has {', '.join(p.placements)})"
        )
    fa = flash_attn or p.flash_attn
    args = ["-m", str(gguf), "-p", str(prompt_tokens), "-n", str(tokens), "-fa", fa, "-r", str(reps), *p.flags]
    args += ["-o", "json"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    max_context = prompt_tokens + tokens + 8
    rows: list[dict] = []

    def emit(new: list[dict]) -> None:
        """Print rows as they are measured (a run cut short keeps them), and rewrite the JSON."""
        for r in new:
            more = "  ".join(f"{k} {v:.3g}" for k, v in r.items() if isinstance(v, float) and k != "tok_s")
            click.echo(f"{r['engine']:<12} {r['placement']:<62} {r['kind']:<8} {r['tok_s']:10.2f} tok/s  {more}")
            click.echo(f"{'':<12} RAM: {r['ram']}")
        rows.extend(new)
        if out:
            out.write_text(json.dumps(rows, indent=1))

    cgroup, own = MemoryCgroup.make() if share else None, {}
    if cgroup:
        cgroup.limit(None)
    for key in placements or p.placements:
        name, extra = PLACEMENTS[key]
        placed, own[key] = llama_rows(build, [*args, *extra], name, cgroup, "uncapped", p)
        emit(placed)
    if share:
        options = RunOptions(device=device, max_context=max_context)
        plan = whole_model_share(plan_engine(model, options), Manifest.open(model), "v3", share)
        ram = plan.record_cache
        streamed = [*args, *PLACEMENTS["exps-cpu"][1]]
        # its own memory as it runs mmapped: where the peer needs another environment for that, measured again
        mapped = own.get("exps-cpu") if not p.mapped_env else None
        own_mem = mapped or llama_rows(build, streamed, "", cgroup, "", p, mapped=True)[1]
        cap = ram + own_mem + CAP_MARGIN
        what = f"a {format_bytes(cap)} cgroup: dsfp4's RAM tier {format_bytes(ram)} + its own {format_bytes(own_mem)}"
        cgroup.limit(cap)
        evict(gguf)
        try:
            emit(llama_rows(build, streamed, "experts on the CPU, mmapped, RAM capped", cgroup, what, p, True)[0])
        except click.ClickException as err:  # dsfp4's rows still count
            click.echo(f"capped {p.name} llama-bench: {err.message}", err=True)
        cgroup.limit(None)
        emit(dsfp4_rows(model, options, plan, f"{device} V3's {share} share", prompt_tokens, tokens))
    for budget in budgets or (() if share else ("",)):
        gpu, _, cpu = budget.partition(":")
        options = RunOptions(device=device, max_context=max_context, gpu_mem=gpu or None, cpu_mem=cpu or None)
        emit(dsfp4_rows(model, options, None, f"{device} {budget or 'free memory'}", prompt_tokens, tokens))


if __name__ == "__main__":
    main()
