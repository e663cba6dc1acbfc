"""The host's C compiler for the CPU kernels: a source compiled once per (source, compiler, CPU) into the user's
cache and loaded with ctypes. -march=native gives the kernel this CPU's vector extensions (AVX2, AVX-512, NEON);
OpenMP spreads it over the cores. The compiler is $CC, else `cc` (Triton needs one on Linux too).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from dsfp4.errors import ConfigError

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120


class KernelUnavailable(ConfigError):
    """A CPU kernel cannot be built here (no compiler, or it failed): the torch reference serves instead."""


def cache_root() -> Path:
    """dsfp4's cache folder: $XDG_CACHE_HOME/dsfp4, else ~/.cache/dsfp4."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dsfp4"


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags (a shared home folder may span machines)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return platform.machine() + "\n" + "\n".join(dict.fromkeys(keep))


@functools.lru_cache
def load(source: Path, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The compiled library of `source`, with `extra` compiler flags after FLAGS (built on first use, then read from
    the cache); KernelUnavailable when it cannot be built here."""
    compiler = os.environ.get("CC") or "cc"
    path = shutil.which(compiler)
    if path is None:
        raise KernelUnavailable(f"no C compiler ({compiler}) on PATH for {source.name}; install gcc or set $CC")
    flags = (*FLAGS, *extra)
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        key = hashlib.sha256("\0".join([source.read_text(), version, _cpu_signature(), *flags]).encode()).hexdigest()
        target = cache_root() / "kernels" / f"{source.stem}-{key[:16]}.so"
        if not target.is_file():
            _build(path, flags, source, target)
    except OSError as e:
        # the compiler will not start, or the cache folder cannot be written
        raise KernelUnavailable(f"cannot build {source.name} into {cache_root() / 'kernels'}: {e}") from None
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        raise KernelUnavailable(f"{target}: cannot load the built kernel ({e}); delete it to rebuild") from None


def _build(compiler: str, flags: tuple[str, ...], source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # built aside, then renamed: never half a file
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        try:
            run = subprocess.run(
                [compiler, *flags, str(source), "-o", str(built), "-lm"],
                capture_output=True,
                text=True,
                timeout=COMPILE_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise KernelUnavailable(f"{compiler} took over {COMPILE_TIMEOUT_S} s on {source.name}") from None
        if run.returncode != 0:
            first = (run.stderr.strip().splitlines() or ["no message"])[0]
            raise KernelUnavailable(f"{Path(compiler).name} failed on {source.name}: {first}")
        built.replace(target)


# a source's paths, by the flags that pick them: this CPU's best (AVX-512 where it has it), AVX2 (most desktop CPUs),
# plain C. Every run takes "native"; the tests compare the others with it where the CPU runs them
PATHS = {"native": (), "avx2": ("-mno-avx512f",), "plain": ("-DDSFP4_PORTABLE",)}


class CFunction:
    """One function of a C source: `get(path)` is it built along one of PATHS, with its argument types set;
    `why_unavailable()` says in a line why it cannot be built here ("" when it can)."""

    def __init__(self, source: Path, name: str, argtypes: list):
        self.source, self.name, self.argtypes = source, name, argtypes

    @functools.lru_cache  # noqa: B019 (one per source function, for the process)
    def get(self, path: str = "native") -> ctypes._CFuncPtr:
        fn = getattr(load(self.source, PATHS[path]), self.name)
        fn.argtypes, fn.restype = self.argtypes, None
        return fn

    @functools.lru_cache  # noqa: B019
    def why_unavailable(self) -> str:
        try:
            self.get()
        except KernelUnavailable as e:
            return str(e)
        return ""

    def available(self) -> bool:
        return self.why_unavailable() == ""
