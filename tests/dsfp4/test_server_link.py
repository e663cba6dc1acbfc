"""The link between the server's processes (dsfp4/server/link.py): jobs, their items and ends, reports and the loss of
the engine's process, with a stand-in scheduler on the engine's end; and what the HTTP process imports."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading

import pytest

from dsfp4.runtime.generate.generation import Delta, Generation
from dsfp4.server.jobs import Job, Progress, QueueFull, Report, post
from dsfp4.server.link import EngineLink, RemoteScheduler
from dsfp4.server.requests import ApiError


class StandIn:
    """The engine's scheduler: it keeps what it is given; the test ends the jobs."""

    def __init__(self, link: EngineLink):
        self.link, self.jobs, self.cancelled = link, {}, []
        self.arrived = threading.Semaphore(0)

    def submit(self, job: Job) -> None:
        job.wait_s = 0.25
        self.jobs[job.id] = job
        self.arrived.release()

    def cancel(self, job: Job) -> None:
        self.cancelled.append(job.id)
        self.end(job, None)

    def end(self, job: Job, outcome: object, result: Generation | None = None) -> None:
        job.send(outcome)
        self.link.done(job, result)

    def snapshot(self) -> Report:
        return Report(True, 1, 2, 3, {"ssd_bytes": 5.0})


def _connection(s: socket.socket):
    from multiprocessing.connection import Connection

    conn = Connection(os.dup(s.fileno()))
    s.close()
    return conn


def test_jobs_cross_the_link_in_order_end_once_and_fail_when_the_engine_goes():
    a, b = socket.socketpair()
    link = EngineLink(_connection(a))
    engine = StandIn(link)
    threading.Thread(target=link.serve, args=(engine,), daemon=True).start()
    ended, lost = [], []

    async def arrived(n: int) -> list[Job]:
        for _ in range(n):
            assert await asyncio.to_thread(engine.arrived.acquire, timeout=10)
        return [engine.jobs[k] for k in sorted(engine.jobs)[-n:]]

    async def items(job: Job, n: int) -> list:
        return [await asyncio.wait_for(job.out.get(), 10) for _ in range(n)]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        remote = RemoteScheduler(_connection(b), 1, 2, lambda j, r: ended.append((j.id, r)), lambda: lost.append(1))
        remote.attach(loop)
        jobs = [Job([1, i], {"max_tokens": 2}, remote.sink(loop)) for i in range(3)]
        for job in jobs:
            remote.submit(job)
        with pytest.raises(QueueFull):  # max_queue 1 + slots 2
            remote.submit(Job([1], {}, remote.sink(loop)))
        there = await arrived(3)
        assert [(j.id, j.prompt_ids, j.options) for j in there] == [(j.id, j.prompt_ids, j.options) for j in jobs]
        done = Generation([1, 0], [7, 8], "ab", "length")
        post([(there[0], Delta(7, "a")), (there[2], Delta(5, "z")), (there[0], Delta(8, "b"))])  # one step's
        engine.end(there[0], done, done)
        got = await items(jobs[0], 3)
        assert got[:2] == [Delta(7, "a"), Delta(8, "b")] and got[2].text == "ab" and got[2].finish_reason == "length"
        assert jobs[0].done.is_set() and jobs[0].wait_s == 0.25 and ended[0][1].token_ids == [7, 8]
        remote.cancel(jobs[1])
        assert await items(jobs[1], 1) == [None] and engine.cancelled == [jobs[1].id] and jobs[1].cancelled.is_set()
        engine.end(there[2], RuntimeError("boom"))
        delta, error = await items(jobs[2], 2)
        assert (
            delta == Delta(5, "z")
            and isinstance(error, ApiError)
            and (error.status, error.message)
            == (
                500,
                "generation failed: boom",
            )
        )
        assert await remote.report() == Report(True, 1, 2, 3, {"ssd_bytes": 5.0})
        assert [k for k, _ in ended] == [j.id for j in jobs] and not remote.jobs and not link.jobs
        waiting = Job([2], {}, remote.sink(loop))
        remote.submit(waiting)  # the queue has room again
        await arrived(1)
        with socket.socket(fileno=os.dup(link.conn.fileno())) as end:  # the engine's process goes
            end.shutdown(socket.SHUT_RDWR)
        (error,) = await items(waiting, 1)
        assert error.status == 503 and error.code == "engine_stopped" and waiting.done.is_set() and lost == [1]
        assert not (await remote.report()).alive
        with pytest.raises(QueueFull):
            remote.submit(Job([1], {}, remote.sink(loop)))

    asyncio.run(main())


def test_a_prefills_progress_crosses_the_link_before_its_tokens_and_reports_carry_it():
    a, b = socket.socketpair()
    link = EngineLink(_connection(a))
    engine = StandIn(link)
    engine.snapshot = lambda: Report(True, 0, 1, 1, {}, 512, 2048)
    threading.Thread(target=link.serve, args=(engine,), daemon=True).start()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        remote = RemoteScheduler(_connection(b), 1, 1, lambda j, r: None, lambda: None)
        remote.attach(loop)
        job = Job([1, 2], {}, remote.sink(loop))
        remote.submit(job)
        assert await asyncio.to_thread(engine.arrived.acquire, timeout=10)
        there = engine.jobs[job.id]
        for item in (Progress(0, 2048), Progress(2048, 2048), Delta(7, "a")):
            there.send(item)
        engine.end(there, None)
        got = [await asyncio.wait_for(job.out.get(), 10) for _ in range(4)]
        assert got == [Progress(0, 2048), Progress(2048, 2048), Delta(7, "a"), None]
        r = await remote.report()
        assert (r.prefill_done, r.prefill_total) == (512, 2048)

    asyncio.run(main())


def test_serve_reads_on_while_the_http_process_does_not():
    """What serve()'s thread sends waits for the link's writer: serve() goes on reading what the HTTP process sends
    (both sides blocked on full socket buffers would stall both processes)."""
    a, b = socket.socketpair()
    link = EngineLink(_connection(a))
    engine = StandIn(link)
    threading.Thread(target=link.serve, args=(engine,), daemon=True).start()
    front = _connection(b)

    def flood() -> None:
        for rid in range(5000):  # replies far past the socket buffers, none of them read
            front.send(("report", rid))
        front.send(("submit", 1, [1, 2], {}, None))

    threading.Thread(target=flood, daemon=True).start()
    assert engine.arrived.acquire(timeout=60), "serve() stopped reading"
    assert front.recv() == ("report", 0, engine.snapshot())  # and the replies come, in order
    front.close()  # the HTTP process goes: serve() and the writer end
    link.close()


def test_an_engine_that_does_not_answer_reads_as_not_alive(monkeypatch):
    from dsfp4.server import link

    monkeypatch.setattr(link, "REPORT_S", 0.05)
    a, b = socket.socketpair()

    async def main() -> Report:
        remote = RemoteScheduler(_connection(b), 1, 2, lambda j, r: None, lambda: None)
        remote.attach(asyncio.get_running_loop())
        return await remote.report()  # nobody reads the other end

    assert asyncio.run(main()) == Report(False, 0, 0, 2, {})
    a.close()


def test_an_api_error_survives_pickling():
    import pickle

    e = pickle.loads(pickle.dumps(ApiError(503, "busy", "model", "queue_full")))
    assert (e.status, e.message, e.param, e.code, str(e)) == (503, "busy", "model", "queue_full", "busy")


def test_the_http_process_imports_no_torch():
    code = "import sys, dsfp4.server.front; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_signal_cancels_on_the_loop_once_not_in_its_handler():
    """The handler may run in the middle of a message to the engine's process: the cancels wait for the loop."""
    import uvicorn

    from dsfp4.server.front import _Server

    class Remote:
        cancels = 0

        def cancel_all(self) -> None:
            self.cancels += 1

    async def main() -> None:
        remote = Remote()
        server = _Server(uvicorn.Config(app=None), remote, asyncio.get_running_loop())
        server.handle_exit(2, None)
        server.handle_exit(15, None)  # a Ctrl-C reaches both processes, and the engine's passes on a SIGTERM
        assert remote.cancels == 0 and server.should_exit and not server.force_exit
        await asyncio.sleep(0)
        assert remote.cancels == 1

    asyncio.run(main())


def test_the_http_process_imports_this_dsfp4_whatever_the_working_directory(tmp_path):
    from dsfp4.server.serve import front_command

    (tmp_path / "dsfp4").mkdir()
    (tmp_path / "dsfp4" / "__init__.py").write_text("raise SystemExit('a decoy dsfp4')")
    r = subprocess.run(front_command("not-a-descriptor", "0"), cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0 and "decoy" not in r.stderr and "server/front.py" in r.stderr, r.stderr
