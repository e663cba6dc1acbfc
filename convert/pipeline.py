"""`dsfp4 convert --fp4`: stream a DeepSeek checkpoint, tensor by tensor, into layout v1.

Jobs (one backbone tensor or one expert each) flow through `workers` threads, part after part, with at
most 2 x workers in flight; each is read, converted and pwritten at its planned offset, so the output
does not depend on the number of workers or their timing. A part is finalized in the background once its
last job is done. Peak memory is bounded by the jobs in flight (plain copies move in 64 MiB chunks), never
by the checkpoint's size.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from tqdm import tqdm

from dsfp4.convert.names.family import map_tensors
from dsfp4.convert.part import JobResult, PartRun
from dsfp4.convert.plan import BackboneChooser, ConvertOptions, Part, Plan, make_plan
from dsfp4.convert.resume import ResumeState
from dsfp4.convert.source.checkpoint import AUX_FILES, INDEX_NAME, SourceCheckpoint
from dsfp4.convert.source.hub import HubSource
from dsfp4.convert.transform import ErrorStats
from dsfp4.device import resolve_device
from dsfp4.errors import OutputError, SourceError
from dsfp4.hub.download_record import check_download
from dsfp4.layout.manifest import ExpertFile, FileEntry, Manifest, TensorEntry
from dsfp4.layout.output_path import free_space
from dsfp4.layout.tokenizer_config import NAME as TOKENIZER_CONFIG
from dsfp4.layout.tokenizer_config import read_tokenizer_config
from dsfp4.layout.writer import ModelWriter
from dsfp4.units import format_bytes, free_bytes

T = TypeVar("T")


@dataclass(frozen=True)
class ConvertResult:
    out: Path
    plan: Plan
    done: bool = False
    seconds: float = 0.0
    converted_bytes: int = 0
    resumed_parts: int = 0
    quant_error: dict[str, float] = field(default_factory=dict)
    # dry run: what a real run would find at OUT
    notes: tuple[str, ...] = ()


def _run_jobs(jobs: Iterable[Callable[[], T]], workers: int, on_done: Callable[[T], None]) -> None:
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


def _disk_shortfall(out: Path, needed: int, reclaimable: int) -> str | None:
    # a read-only or foreign folder is refused as such, not reported as full
    probe, free = free_space(out, "OUT")
    if needed <= free + reclaimable:
        return None
    return (
        f"not enough free disk space for {out}: the conversion needs {format_bytes(needed)}, "
        f"{format_bytes(free + reclaimable)} are free; free some space or choose another OUT"
    )


def _resume_key(plan: Plan, src: SourceCheckpoint, hub: HubSource | None) -> str:
    """The plan plus the shards' modification times: a re-downloaded shard restarts the conversion. Shards
    fetched from the hub count by their hash (they come and go during a --from-hub run)."""
    times = [
        hub.files[s].blob if hub is not None and s in hub.files else (src.path / s).stat().st_mtime_ns
        for s in src.shards
    ]
    return hashlib.sha256(json.dumps([plan.fingerprint, times]).encode()).hexdigest()


def _source_need(out: Path, src: SourceCheckpoint, hub: HubSource | None, todo: list[Part]) -> tuple[int, str | None]:
    """(bytes of hub source to count on OUT's disk, a shortfall on the source's own disk or None)."""
    if hub is None:
        return 0, None
    need = hub.disk_need([part_shards(src, p) for p in todo])
    folder = hub.plan.target
    if os.stat(folder).st_dev == os.stat(free_bytes(out)[0]).st_dev:
        return need, None
    free = free_bytes(folder)[1]
    short = f"not enough free disk for the source in {folder}: {format_bytes(need)} needed, {format_bytes(free)} free"
    return 0, short if need > free else None


def _dry_run_notes(
    out: Path, plan: Plan, key: str, force: bool, src: SourceCheckpoint, hub: HubSource | None
) -> tuple[str, ...]:
    """What a real run would find at OUT: disk space, a resumable state, or a refusal."""
    try:
        state = ResumeState(out, key, force)
    except OutputError as e:
        return (f"a real run would stop here: {e}",)
    done = [p for p in plan.parts if state.done(p.name) is not None]
    source, short = _source_need(out, src, hub, [p for p in plan.parts if p not in done])
    needed = plan.out_bytes - sum(p.out_bytes for p in done) + source
    probe, free = free_bytes(out)
    notes = [f"disk    needs {format_bytes(needed)}; {format_bytes(free)} free on {probe}"]
    if hub is not None:
        kept = "deleted once converted" if hub.delete else "all kept (--delete-source keeps a few)"
        notes.append(f"source  shards fetched from the hub as needed, {kept}: up to {format_bytes(source)} at once")
    if short:
        notes.append(f"a real run would stop here: {short}")
    if state.mode == "resume":
        notes.append(f"resume  {len(done)} of {len(plan.parts)} parts were done by an interrupted run")
    if state.mode == "overwrite":
        notes.append(f"force   replaces the converted files in {out} ({format_bytes(state.reclaimable_bytes())})")
    if shortfall := _disk_shortfall(out, needed, state.reclaimable_bytes()):
        notes.append(f"a real run would stop here: {shortfall}")
    return tuple(notes)


def part_shards(src: SourceCheckpoint, part: Part) -> set[str]:
    """The source shards a part reads."""
    names = [n for t in part.backbone for n in t.item.sources.values()]
    names += [n for triple in part.experts for m in triple for n in m.sources.values()]
    return src.shards_of(names)


def _run_parts(
    src: SourceCheckpoint,
    plan: Plan,
    todo: list[Part],
    out: Path,
    device: torch.device,
    state: ResumeState,
    markers: dict[str, dict],
    bar: tqdm,
    hub: HubSource | None = None,
) -> None:
    """Run every job of every part; finalize each part (one at a time, in part order) in the background as
    soon as its last job is done, while later parts' jobs go on."""
    runs: list[PartRun] = []

    def jobs() -> Iterator[Callable[[], tuple[PartRun, JobResult]]]:
        for part in todo:
            if hub is not None:
                hub.need(part_shards(src, part))
            run = PartRun(src, plan, part, out, device)
            runs.append(run)
            bar.set_description(part.name)
            yield from (lambda run=run, job=job: (run, job()) for job in run.jobs())

    def finish(run: PartRun) -> None:
        markers[run.part.name] = run.finalize()
        state.mark(run.part.name, markers[run.part.name])
        if hub is not None:
            hub.done(part_shards(src, run.part), src.release)

    with ThreadPoolExecutor(1, thread_name_prefix="dsfp4-finalize") as finalizer:
        pending: list[Future] = []

        def on_done(item: tuple[PartRun, JobResult]) -> None:
            run, result = item
            bar.update(result.in_bytes)
            if run.done(result):
                if pending:
                    # surface a failed finalize before going on
                    pending.pop().result()
                pending.append(finalizer.submit(finish, run))

        try:
            _run_jobs(jobs(), plan.options.workers, on_done)
            if pending:
                pending.pop().result()
        except BaseException:
            # let a finalize in flight end before closing files under it
            for f in pending:
                f.exception()
            for run in runs:
                if run.part.name not in markers:
                    run.abort()
            raise


def _round_sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def check_source_tokenizer_config(src_path: Path) -> None:
    """The source's tokenizer_config.json, where it has one, in the shape the runtime reads (SourceError)."""
    read_tokenizer_config(src_path / TOKENIZER_CONFIG, SourceError, "fix it or download the checkpoint again")


def _write_manifest(plan: Plan, markers: dict[str, dict], src_path: Path, out: Path) -> Manifest:
    """Copy the source's files beside the model, then write the manifest from the parts' markers."""
    w = ModelWriter(out)
    stats: dict[str, ErrorStats] = {}
    for part in plan.parts:
        m = markers[part.name]
        tensors = {t.item.ref: TensorEntry(part.backbone_file, t.format, t.item.shape, t.names) for t in part.backbone}
        w.backbone(m["backbone"]["file"], FileEntry(m["backbone"]["nbytes"], m["backbone"]["sha256"]), tensors)
        if "experts" in m:
            ex = m["experts"]
            w.expert_file(part.block, ExpertFile(ex["file"], tuple(ex["offsets"]), tuple(ex["sha256"])))
        for k, (sse, ssr) in m["quant_error"].items():
            stats.setdefault(k, ErrorStats()).merge(ErrorStats(sse, ssr))
    check_source_tokenizer_config(src_path)
    for name in AUX_FILES:
        if (src_path / name).is_file():
            tmp = out / (name + ".partial")
            shutil.copyfile(src_path / name, tmp)
            os.replace(tmp, out / name)
            w.copied(name)
    skipped: dict[str, int] = {}
    for reason in plan.skipped.values():
        skipped[reason] = skipped.get(reason, 0) + 1
    quant_error = {k: _round_sig(s.relative_rms) for k, s in sorted(stats.items())}
    return w.finish(
        plan.args, plan.source_info, plan.manifest_options(), plan.record, dict(sorted(skipped.items())), quant_error
    )


def convert(
    src_path: Path,
    out_path: Path,
    options: ConvertOptions,
    progress: bool = True,
    hub: HubSource | None = None,
    choose_backbone: BackboneChooser | None = None,
    verify: bool = False,
) -> ConvertResult:
    """Convert SRC (a Hugging Face DeepSeek checkpoint folder) into layout v1 at OUT.

    With options.dry_run only the plan is made (nothing is written). Raises DsfpError subclasses for bad
    input; on any failure OUT has no manifest.json, and a rerun resumes from the finished parts. A SRC that `dsfp4
    download` fetched is first checked against its record (`verify`: every file hashed); `hub` checks its own.
    """
    src_path, out = Path(src_path), Path(out_path)
    device = resolve_device(options.device)
    if hub is None and src_path.is_dir():
        check_download(src_path, verify)
    with SourceCheckpoint(src_path, no_mtp=options.no_mtp, remote=hub.remote if hub else None) as src:
        # the runtime reads it: a damaged one fails here, not after the conversion
        check_source_tokenizer_config(src_path)
        where = {n: t.shard for n, t in src.tensors.items()}
        tmap = map_tensors(
            src.args,
            {n: t.info for n, t in src.tensors.items()},
            where,
            INDEX_NAME if len(src.shards) > 1 else src.shards[0],
            include_mtp=not options.no_mtp,
        )
        plan = make_plan(src, tmap, options, choose_backbone)
        if out.resolve() == src_path.resolve():
            raise OutputError(f"{out}: OUT must differ from SRC")
        key = _resume_key(plan, src, hub)
        if options.dry_run:
            return ConvertResult(out, plan, notes=_dry_run_notes(out, plan, key, options.force, src, hub))
        state = ResumeState(out, key, options.force)
        markers = {p.name: m for p in plan.parts if (m := state.done(p.name)) is not None}
        todo = [p for p in plan.parts if p.name not in markers]
        source, short = _source_need(out, src, hub, todo)
        if short:
            raise OutputError(short)
        if shortfall := _disk_shortfall(out, sum(p.out_bytes for p in todo) + source, state.reclaimable_bytes()):
            raise OutputError(shortfall)
        state.prepare()
        try:
            start = time.perf_counter()
            with tqdm(
                total=plan.in_bytes,
                initial=plan.in_bytes - sum(p.in_bytes for p in todo),
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                disable=not progress,
                file=sys.stderr,
                dynamic_ncols=True,
            ) as bar:
                # its owner closes it (it is a context manager)
                if hub is not None:
                    hub.start([part_shards(src, p) for p in todo])
                _run_parts(src, plan, todo, out, device, state, markers, bar, hub)
            manifest = _write_manifest(plan, markers, src_path, out)
            state.finish()
        finally:
            state.release()
        resumed = len(plan.parts) - len(todo)
    return ConvertResult(
        out, plan, True, time.perf_counter() - start, sum(p.in_bytes for p in todo), resumed, manifest.quant_error
    )
