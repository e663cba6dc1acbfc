"""A server stopped by SIGTERM exits 0 and says nothing of leaks: the engine's process froze its objects for the
collector (serve.py), and frozen ones escaped the collection at the interpreter's exit, so Triton's nanobind objects
in cycles outlived it and nanobind printed each as leaked. It reproduces on the CPU wherever Triton is installed
(the engine imports it, kernels/backend.py)."""

from __future__ import annotations

from tests.fixtures.server import serve


def test_a_server_stopped_by_sigterm_exits_0_without_nanobind_leak_reports(converted):
    with serve(converted) as s:
        s.proc.terminate()
        _, err = s.proc.communicate(timeout=60)
    assert s.proc.returncode == 0, err[-2000:]
    assert "nanobind" not in err and "leaked" not in err, err[-2000:]
