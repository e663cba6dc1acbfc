"""One conversion in this fresh process, with its resident memory: prints JSON (seconds, converted bytes, RSS
after the imports and the peak, both from /proc/self/status, and the quantization error). bench_convert.py
runs it per configuration; tests/convert/test_memory.py checks the peak against its bound with it.

    python scripts/convert_rss.py SRC OUT WORKERS DEVICE
"""

from __future__ import annotations

import json
import sys
import time

from dsfp4.convert.pipeline import convert
from dsfp4.convert.plan import ConvertOptions


def status_kib(field: str) -> int:
    """A /proc/self/status field in KiB: per process (ru_maxrss would carry the parent's peak across fork + exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def main(src: str, out: str, workers: str, device: str) -> None:
    base = status_kib("VmRSS")
    t = time.perf_counter()
    r = convert(src, out, ConvertOptions(workers=int(workers), device=device), progress=False)
    seconds = time.perf_counter() - t
    print(
        json.dumps(
            {
                "seconds": seconds,
                "base_kib": base,
                "bytes": r.converted_bytes,
                "peak_kib": status_kib("VmHWM"),
                "quant_error": r.quant_error,
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:5])
