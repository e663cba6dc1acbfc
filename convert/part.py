"""One part of a conversion in progress: its temporary files, its jobs, and its finalization.

Jobs write at planned offsets, so they may finish in any order; when the last one has reported, the
part is finalized (fsync, rename to the final names, hash, marker), which the pipeline does in the
background while later parts' jobs run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dsfp4.convert.plan import Part, Plan
from dsfp4.convert.source.checkpoint import SourceCheckpoint
from dsfp4.convert.transform import ErrorStats, expert_record, write_backbone_tensor
from dsfp4.layout.atomic import fsync_dir
from dsfp4.layout.safetensors_file import SafetensorsWriter, file_sha256
from dsfp4.layout.writer import ExpertFileWriter


@dataclass
class JobResult:
    in_bytes: int
    klass: str
    stats: ErrorStats | None


class PartRun:
    """Open temporary files of one part; jobs() fill them, done() counts results, finalize() closes."""

    def __init__(self, src: SourceCheckpoint, plan: Plan, part: Part, out: Path, device: torch.device):
        self.src, self.part, self.device, self.record = src, part, device, plan.record
        self.bb_path = out / part.backbone_file
        self.bb_tmp = self.bb_path.with_name(self.bb_path.name + ".partial")
        self.writer = SafetensorsWriter(self.bb_tmp, [e for t in part.backbone for e in t.entries()])
        self.experts = None
        try:
            if part.experts:
                self.experts = ExpertFileWriter(out, part.experts_file, len(part.experts), self.record.nbytes)
        except BaseException:
            self.abort()
            raise
        self.stats: dict[str, ErrorStats] = {}
        self.remaining = len(part.backbone) + len(part.experts)

    def jobs(self) -> list[Callable[[], JobResult]]:
        return [lambda t=t: self._backbone_job(t) for t in self.part.backbone] + [
            lambda e=e: self._expert_job(e) for e in range(len(self.part.experts))
        ]

    def _backbone_job(self, t) -> JobResult:
        st = write_backbone_tensor(self.src, t, self.writer, self.device)
        n = sum(self.src.tensors[s].info.nbytes for s in t.item.sources.values())
        return JobResult(n, f"backbone {t.item.storage} -> {t.format}", st)

    def _expert_job(self, e: int) -> JobResult:
        trio = self.part.experts[e]
        buf, st = expert_record(self.src, trio, self.record, self.device)
        self.experts.write(e, buf)
        n = sum(self.src.tensors[s].info.nbytes for i in trio for s in i.sources.values())
        return JobResult(n, f"experts {trio[0].storage} -> {self.record.format}", st)

    def done(self, r: JobResult) -> bool:
        """Account for one finished job; True once the part has no job left."""
        if r.stats is not None:
            self.stats.setdefault(r.klass, ErrorStats()).merge(r.stats)
        self.remaining -= 1
        return self.remaining == 0

    def finalize(self) -> dict:
        """Make the files durable under their final names; returns the part's marker."""
        self.writer.close()
        os.replace(self.bb_tmp, self.bb_path)
        bb = {
            "file": self.part.backbone_file,
            "nbytes": self.bb_path.stat().st_size,
            "sha256": file_sha256(self.bb_path),
        }
        marker = {"backbone": bb, "quant_error": {k: [s.sse, s.ssr] for k, s in sorted(self.stats.items())}}
        if self.experts is not None:
            ef = self.experts.finish()
            nbytes = (self.experts.path).stat().st_size
            marker["experts"] = {
                "file": ef.file,
                "nbytes": nbytes,
                "offsets": list(ef.offsets),
                "sha256": list(ef.sha256),
            }
        marker["sizes"] = {m["file"]: m["nbytes"] for k in ("backbone", "experts") if (m := marker.get(k))}
        fsync_dir(self.bb_path.parent)
        return marker

    def abort(self) -> None:
        """Close the files after a failure (safe to call twice); the next run redoes this part."""
        self.writer.abort()
        if self.experts is not None:
            self.experts.abort()
