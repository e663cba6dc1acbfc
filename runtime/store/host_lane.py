"""The CPU lane (--cpu-experts): some of a decode step's RAM hits computed by the host's cores, from their RAM records
in place (kernels/cpu/moe.c), while the GPU computes the rest and PCIe carries their copies. With every expert that is
not on the device crossing PCIe once, ~50 GB/s of pinned PCIe bounds a step whatever the RAM hit rate; the cores lift
that bound by the share of those experts they take: CPU GB/s / (CPU GB/s + PCIe GB/s), so both finish together
(`share`, measured when the engine starts: runtime/plan/probes.py).

A step's host experts are decided on the main thread (StepLevers.host_split, by lever_rules.host_candidates: RAM
hits of the model's format, their RAM slots pinned until the job is collected); the job runs on one worker thread whose
kernel spreads over the cores, while the main thread queues the device's loads and kernels; its [T, D] result is added
to the layer's output.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from dsfp4.kernels.cpu import moe as host_moe
from dsfp4.layout.record import RecordLayout
from dsfp4.layout.record_offsets import ABSENT
from dsfp4.runtime.store.counters import StoreCounters


class HostJob:
    """One step's experts computed on the host (`experts`): result() waits for y [T, D] fp32 (the wait counted as
    host_wait_s) and unpins their RAM slots."""

    def __init__(
        self, future: Future, slots: dict[int, int], release: Callable[[int], None], counters: StoreCounters
    ) -> None:
        self.experts = list(slots)
        self._future, self._unpin, self._release, self._counters = future, list(slots.values()), release, counters

    def abandon(self) -> None:
        """The step failed: wait for the job, whatever it raises, and unpin its slots."""
        # the step's own error is the one raised
        with contextlib.suppress(Exception):
            self.result()

    def result(self) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return self._future.result()
        finally:
            self._counters.host_wait_s += time.perf_counter() - t0
            for rslot in self._unpin:
                self._release(rslot)
            self._unpin = []


@contextlib.contextmanager
def abandoned_on_error(job: HostJob | None) -> Iterator[None]:
    """Around what a step does between starting the host's job and collecting it: if it fails, the job is waited for
    and its RAM slots unpinned (they stay pinned until the job is collected)."""
    try:
        yield
    except BaseException:
        if job is not None:
            job.abandon()
        raise


class HostLane:
    """The worker and the kernel's arguments for one store: `ram` [slots, nbytes] its RAM records, `layout` theirs,
    `limit` the experts' SwiGLU clamp."""

    def __init__(
        self,
        ram: torch.Tensor,
        layout: RecordLayout,
        n_experts: int,
        limit: float,
        share: float,
        counters: StoreCounters,
    ):
        self.ram, self.layout, self.n_experts, self.limit, self.share = ram, layout, n_experts, limit, share
        self.counters = counters
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="dsfp4-cpu-experts")

    def submit(
        self,
        slots: dict[int, int],
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        release: Callable[[int], None],
    ) -> HostJob:
        """slots: expert -> its RAM slot (pinned; `release` unpins one); x: [T, D], ids: [T, K], weights: [T, K] on
        the host, as the device's kernel weighs the same choices -> the job."""
        offsets = torch.full((self.n_experts,), ABSENT, dtype=torch.int64)  # [E]
        for e, rslot in slots.items():
            offsets[e] = rslot * self.ram.shape[1]
        future = self.worker.submit(self._run, x, ids, weights, offsets)
        return HostJob(future, slots, release, self.counters)

    def _run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        y = host_moe.moe_host(x, ids, weights, self.ram, offsets, self.layout, self.limit)
        self.counters.add_host(time.perf_counter() - t0)
        return y

    def close(self) -> None:
        self.worker.shutdown(wait=True)
