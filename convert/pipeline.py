"""`dsfp4 convert --fp4`: stream a DeepSeek checkpoint, tensor by tensor, into layout v1.

Parts run one after another; inside a part, up to `workers` tensors or experts are in flight at once,
each read, converted and pwritten at its planned offset, so the output does not depend on the number of
workers. Peak memory is bounded by 2 x workers jobs (one job holds one expert or one backbone tensor;
plain copies move in 64 MiB chunks), never by the checkpoint's size.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from dsfp4.convert.hf_names import map_tensors
from dsfp4.convert.plan import ConvertOptions, Part, Plan, make_plan
from dsfp4.convert.resume import ResumeState
from dsfp4.convert.source import AUX_FILES, INDEX_NAME, SourceCheckpoint
from dsfp4.convert.transform import ErrorStats, expert_record, write_backbone_tensor
from dsfp4.errors import ConfigError, OutputError
from dsfp4.layout.atomic import fsync_dir
from dsfp4.layout.manifest import ExpertFile, FileEntry, Manifest, TensorEntry
from dsfp4.layout.record import record_sha256
from dsfp4.layout.safetensors_file import SafetensorsWriter, file_sha256, pwrite_all
from dsfp4.sizes import format_bytes


@dataclass(frozen=True)
class ConvertResult:
    out: Path
    plan: Plan
    done: bool = False
    seconds: float = 0.0
    converted_bytes: int = 0
    resumed_parts: int = 0
    quant_error: dict[str, float] = field(default_factory=dict)


@dataclass
class _JobResult:
    in_bytes: int
    klass: str
    stats: ErrorStats | None
    expert: int | None = None
    sha256: str | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA device is available; use --device cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"--device {name}: {e}") from e
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _run_jobs(jobs: Iterable[Callable[[], _JobResult]], workers: int, on_done: Callable[[_JobResult], None]) -> None:
    """Run jobs with at most 2 x workers in flight, handing results over in submission order."""
    if workers == 1:
        for job in jobs:
            on_done(job())
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="dsfp4-convert")
    window: deque = deque()
    try:
        for job in jobs:
            window.append(pool.submit(job))
            if len(window) >= 2 * workers:
                on_done(window.popleft().result())
        while window:
            on_done(window.popleft().result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _check_disk(out: Path, needed: int) -> None:
    probe = out
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise OutputError(
            f"not enough free disk space for {out}: the conversion needs {format_bytes(needed)}, "
            f"{format_bytes(free)} are free; free some space or choose another OUT"
        )


def _run_part(
    src: SourceCheckpoint, plan: Plan, part: Part, out: Path, device: torch.device, bar: tqdm
) -> Callable[[], dict]:
    """Convert one part into temporary files. Returns its finalizer, which makes the files durable,
    renames them and returns the part's marker; it runs in the background while the next part converts."""
    bb_path = out / part.backbone_file
    bb_tmp = bb_path.with_name(bb_path.name + ".partial")
    writer = SafetensorsWriter(bb_tmp, [e for t in part.backbone for e in t.entries()])
    jobs: list[Callable[[], _JobResult]] = []
    for t in part.backbone:

        def backbone_job(t=t) -> _JobResult:
            st = write_backbone_tensor(src, t, writer, device)
            n = sum(src.tensors[s].info.nbytes for s in t.item.sources.values())
            return _JobResult(n, f"backbone {t.item.storage} -> {t.format}", st)

        jobs.append(backbone_job)
    record = plan.record
    ex_path = out / part.experts_file if part.experts else None
    ex_tmp = ex_path.with_name(ex_path.name + ".partial") if ex_path else None
    ex_fd = os.open(ex_tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644) if ex_tmp else None
    for e, trio in enumerate(part.experts):

        def expert_job(e=e, trio=trio) -> _JobResult:
            buf, st = expert_record(src, trio, record, device)
            pwrite_all(ex_fd, buf, e * record.nbytes)
            n = sum(src.tensors[s].info.nbytes for i in trio for s in i.sources.values())
            return _JobResult(n, f"experts {trio[0].storage} -> {record.format}", st, e, record_sha256(buf))

        jobs.append(expert_job)
    stats: dict[str, ErrorStats] = {}
    shas: list[str | None] = [None] * len(part.experts)

    def on_done(r: _JobResult) -> None:
        bar.update(r.in_bytes)
        if r.stats is not None:
            stats.setdefault(r.klass, ErrorStats()).merge(r.stats)
        if r.expert is not None:
            shas[r.expert] = r.sha256

    try:
        if ex_fd is not None:
            os.ftruncate(ex_fd, len(part.experts) * record.nbytes)
        _run_jobs(jobs, plan.options.workers, on_done)
    except BaseException:
        writer.abort()
        if ex_fd is not None:
            os.close(ex_fd)
        raise

    def finalize() -> dict:
        writer.close()
        os.replace(bb_tmp, bb_path)
        marker = {
            "backbone": {"file": part.backbone_file, "nbytes": bb_path.stat().st_size, "sha256": file_sha256(bb_path)},
            "quant_error": {k: [s.sse, s.ssr] for k, s in sorted(stats.items())},
        }
        if ex_fd is not None:
            os.fsync(ex_fd)
            os.close(ex_fd)
            os.replace(ex_tmp, ex_path)
            marker["experts"] = {
                "file": part.experts_file,
                "nbytes": ex_path.stat().st_size,
                "offsets": [e * record.nbytes for e in range(len(part.experts))],
                "sha256": shas,
            }
        marker["sizes"] = {m["file"]: m["nbytes"] for k in ("backbone", "experts") if (m := marker.get(k))}
        fsync_dir(bb_path.parent)
        return marker

    return finalize


def _finish_part(state: ResumeState, name: str, finalize: Callable[[], dict], markers: dict[str, dict]) -> None:
    markers[name] = finalize()
    state.mark(name, markers[name])


def _round_sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _manifest(plan: Plan, markers: dict[str, dict], aux: dict[str, FileEntry]) -> Manifest:
    tensors, files, experts = {}, {}, {}
    stats: dict[str, ErrorStats] = {}
    for part in plan.parts:
        m = markers[part.name]
        for t in part.backbone:
            tensors[t.item.ref] = TensorEntry(part.backbone_file, t.format, t.item.shape, t.names)
        files[m["backbone"]["file"]] = FileEntry(m["backbone"]["nbytes"], m["backbone"]["sha256"])
        if "experts" in m:
            experts[part.block] = ExpertFile(
                m["experts"]["file"], tuple(m["experts"]["offsets"]), tuple(m["experts"]["sha256"])
            )
        for k, (sse, ssr) in m["quant_error"].items():
            stats.setdefault(k, ErrorStats()).merge(ErrorStats(sse, ssr))
    skipped: dict[str, int] = {}
    for reason in plan.skipped.values():
        skipped[reason] = skipped.get(reason, 0) + 1
    return Manifest(
        plan.args,
        plan.source_info,
        plan.manifest_options(),
        tensors,
        {**files, **aux},
        plan.record,
        experts,
        dict(sorted(skipped.items())),
        {k: _round_sig(s.relative_rms) for k, s in sorted(stats.items())},
    )


def _copy_aux(src_dir: Path, out: Path) -> dict[str, FileEntry]:
    files = {}
    for name in AUX_FILES:
        if (src_dir / name).is_file():
            tmp = out / (name + ".partial")
            shutil.copyfile(src_dir / name, tmp)
            os.replace(tmp, out / name)
            files[name] = FileEntry((out / name).stat().st_size, file_sha256(out / name))
    return files


def convert(src_path: Path, out_path: Path, options: ConvertOptions, progress: bool = True) -> ConvertResult:
    """Convert SRC (a Hugging Face DeepSeek checkpoint folder) into layout v1 at OUT.

    With options.dry_run only the plan is made (nothing is written). Raises DsfpError subclasses for bad
    input; on any failure OUT has no manifest.json, and a rerun resumes from the finished parts.
    """
    src_path, out = Path(src_path), Path(out_path)
    device = resolve_device(options.device)
    with SourceCheckpoint(src_path) as src:
        where = {n: t.shard for n, t in src.tensors.items()}
        tmap = map_tensors(
            src.args,
            {n: t.info for n, t in src.tensors.items()},
            where,
            INDEX_NAME if len(src.shards) > 1 else src.shards[0],
            include_mtp=not options.no_mtp,
        )
        plan = make_plan(src, tmap, options)
        if options.dry_run:
            return ConvertResult(out, plan)
        if out.resolve() == src_path.resolve():
            raise OutputError(f"{out}: OUT must differ from SRC")
        state = ResumeState(out, plan.fingerprint, options.force)
        markers = {p.name: m for p in plan.parts if (m := state.done(p.name)) is not None}
        _check_disk(out, sum(p.out_bytes for p in plan.parts if p.name not in markers))
        resumed = len(markers)
        start = time.perf_counter()
        todo = [p for p in plan.parts if p.name not in markers]
        with (
            tqdm(
                total=plan.in_bytes,
                initial=plan.in_bytes - sum(p.in_bytes for p in todo),
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                disable=not progress,
                file=sys.stderr,
                dynamic_ncols=True,
            ) as bar,
            ThreadPoolExecutor(1, thread_name_prefix="dsfp4-finalize") as finalizer,
        ):
            pending = None  # at most one part finalizing (fsync, rename, hash, marker) behind the current one
            for part in todo:
                bar.set_description(part.name)
                finalize = _run_part(src, plan, part, out, device, bar)
                if pending is not None:
                    pending.result()
                pending = finalizer.submit(_finish_part, state, part.name, finalize, markers)
            if pending is not None:
                pending.result()
        manifest = _manifest(plan, markers, _copy_aux(src_path, out))
        manifest.write(out)
        state.finish()
    return ConvertResult(
        out, plan, True, time.perf_counter() - start, sum(p.in_bytes for p in todo), resumed, manifest.quant_error
    )
