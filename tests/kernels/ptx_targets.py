"""Triton kernels compiled for a GPU this machine does not have: Triton's CUDA backend and its bundled ptxas run
without a device, so a test can see that a kernel builds for sm_80 (no instruction of a later GPU in it) and how
much shared memory Triton allots it there. The tests run under TRITON_INTERPRET, whose kernels cannot be compiled,
so the compiles run in a child process without it (one for a whole list of them)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys

import pytest

# launches specialize pointers and integers divisible by 16 (DeepSeek's shapes are): the loads then vectorize and
# the K loops pipeline, which is what sets a kernel's shared memory
DIVISIBLE = 16
# a child's compiles take a few seconds each
TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Build:
    """One compile: `kernel` ("module:name" of a triton.jit function) for sm_<capability>; args names every
    argument, a type string ("*bf16", "i32") for a runtime one, a value for a constexpr ("tl.bfloat16" for a dtype)."""

    kernel: str
    capability: tuple[int, int]
    args: dict
    num_warps: int = 4
    num_stages: int = 2


# a runtime argument's type: i32, u8, fp32, bf16, *fp16, *fp8e4nv
RUNTIME_TYPE = re.compile(r"^\*?(i|u|fp|bf)\d+(e4nv)?$")


def _runtime(v) -> bool:
    return isinstance(v, str) and RUNTIME_TYPE.match(v) is not None


def _constant(v):
    """A constexpr as JSON carries it: "tl.bfloat16" names a Triton dtype."""
    import triton.language as tl

    return getattr(tl, v[3:]) if isinstance(v, str) and v.startswith("tl.") else v


def _compile(b: dict) -> int | str:
    """Shared memory bytes of the compiled kernel, or the compiler's error (its last line)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name = b["kernel"].split(":")
    fn = getattr(importlib.import_module(module), name)
    args, names = b["args"], fn.arg_names
    assert set(args) == set(names), f"{name}: arguments {set(names) ^ set(args)}"
    sig = {n: args[n] if _runtime(args[n]) else "constexpr" for n in names}
    constants = {n: _constant(args[n]) for n in names if not _runtime(args[n])}
    attrs = {(i,): [["tt.divisibility", DIVISIBLE]] for i, n in enumerate(names) if _runtime(args[n])}
    major, minor = b["capability"]
    target = GPUTarget("cuda", major * 10 + minor, 32)
    options = dict(num_warps=b["num_warps"], num_stages=b["num_stages"])
    try:
        return triton.compile(ASTSource(fn, sig, constants, attrs), target=target, options=options).metadata.shared
    except Exception as e:  # what the compiler or ptxas said, for the test to read
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"


def shared_bytes(builds: list[Build]) -> list[int | str]:
    """Each build's shared memory (bytes), or its compile error as a string; skips where this Triton cannot
    compile for CUDA offline."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    job = json.dumps([dataclasses.asdict(b) for b in builds])
    run = subprocess.run(
        [sys.executable, "-m", "tests.kernels.ptx_targets"],
        input=job,
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,
        check=False,
    )
    if run.returncode != 0:
        pytest.skip(f"Triton cannot compile for CUDA here: {run.stderr.strip().splitlines()[-1:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as e:
        sys.exit(f"no CUDA backend: {e}")
    print(json.dumps([_compile(b) for b in json.loads(sys.stdin.read())]))
