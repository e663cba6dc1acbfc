"""The files `dsfp4 bench` writes: bench.json (everything), bench.csv (a row per preset) and bench.html, a
page a person can open: the run's facts, a table, and three charts drawn as inline SVG (no plotting
library): tok/s per preset, the time of a decode token split into waiting and computing beside its floor,
and where each layer's experts came from.
"""

from __future__ import annotations

import csv
import html
import json
from collections.abc import Callable
from pathlib import Path

from dsfp4.units import format_bytes

COLORS = ("#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377")
CSV_FIELDS = (
    "preset",
    "decode_tok_s",
    "prefill_tok_s",
    "ttft_s",
    "efficiency",
    "floor_s_per_token",
    "stall_s_per_token",
    "compute_s_per_token",
    "gpu_hit_rate",
    "ram_hit_rate",
    "ssd_rate",
    "peak_gpu",
    "peak_rss",
    "decode_mode",
)


def write_reports(out: Path, meta: dict, results: list[dict]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json", out / "bench.csv", out / "bench.html"]
    paths[0].write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
    with paths[1].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["commit", "command", *CSV_FIELDS, "ssd_bytes_per_token", "h2d_bytes_per_token"])
        for r in results:
            per = r["bytes_per_token"]
            w.writerow([meta["commit"], meta["command"], *(r[k] for k in CSV_FIELDS), per["ssd"], per["h2d"]])
    paths[2].write_text(page(meta, results))
    return paths


def _svg(width: int, height: int, body: list[str], title: str) -> str:
    head = f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
    head += f'font-size="12"><text x="{width // 2}" y="16" text-anchor="middle" font-weight="bold">'
    return head + html.escape(title) + "</text>" + "".join(body) + "</svg>"


def bar_chart(labels: list[str], series: dict[str, list[float]], title: str, unit: str) -> str:
    """Grouped vertical bars: one group per label, one bar per series."""
    width, height, top, bottom, left = 120 + 110 * len(labels), 300, 30, 50, 60
    peak = max([v for vs in series.values() for v in vs] + [1e-9])
    plot_h, group = height - top - bottom, 110
    bar = (group - 20) / max(len(series), 1)
    body = [f'<line x1="{left}" y1="{height - bottom}" x2="{width - 20}" y2="{height - bottom}" stroke="#333"/>']
    for i, label in enumerate(labels):
        x0 = left + 10 + i * group
        body.append(
            f'<text x="{x0 + group / 2 - 10}" y="{height - bottom + 16}" text-anchor="middle">'
            f"{html.escape(label)}</text>"
        )
        for j, (name, values) in enumerate(series.items()):
            h = plot_h * values[i] / peak
            x, y = x0 + j * bar, height - bottom - h
            body.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar - 2:.1f}" height="{h:.1f}" fill="{COLORS[j]}">'
                f"<title>{html.escape(name)}: {values[i]:.3g} {unit}</title></rect>"
            )
            body.append(f'<text x="{x + bar / 2:.1f}" y="{y - 3:.1f}" text-anchor="middle">{values[i]:.3g}</text>')
    body += _legend(list(series), left, height - 14)
    return _svg(width, height, body, title)


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def percent(share: float) -> str:
    return f"{share:.1%}"


def stacked_bars(
    labels: list[str],
    parts: dict[str, list[float]],
    marks: list[float | None],
    title: str,
    fmt: Callable[[float], str] = milliseconds,
) -> str:
    """Horizontal stacked bars (one per label), with a black tick at each mark (the floor); `fmt` writes a value."""
    width, row, left, top = 720, 34, 110, 30
    height = top + row * len(labels) + 40
    peak = max([sum(v) for v in zip(*parts.values(), strict=True)] + [m or 0 for m in marks] + [1e-9])
    scale = (width - left - 30) / peak
    body = []
    for i, label in enumerate(labels):
        y, x = top + i * row, left
        body.append(f'<text x="{left - 6}" y="{y + 17}" text-anchor="end">{html.escape(label)}</text>')
        for j, (name, values) in enumerate(parts.items()):
            w = values[i] * scale
            body.append(
                f'<rect x="{x:.1f}" y="{y + 4}" width="{w:.1f}" height="{row - 10}" fill="{COLORS[j]}">'
                f"<title>{html.escape(name)}: {fmt(values[i])}</title></rect>"
            )
            x += w
        if marks[i]:
            mx = left + marks[i] * scale
            body.append(
                f'<line x1="{mx:.1f}" y1="{y}" x2="{mx:.1f}" y2="{y + row - 2}" stroke="black" '
                f'stroke-width="3"><title>floor: {fmt(marks[i])}</title></line>'
            )
        body.append(f'<text x="{x + 4:.1f}" y="{y + 17}">{fmt(sum(v[i] for v in parts.values()))}</text>')
    body += _legend([*parts, "floor (black tick)"], left, height - 12)
    return _svg(width, height, body, title)


def _legend(names: list[str], x: float, y: float) -> list[str]:
    out = []
    for j, name in enumerate(names):
        color = COLORS[j] if j < len(COLORS) else "black"
        out.append(f'<rect x="{x + j * 150}" y="{y - 10}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{x + j * 150 + 14}" y="{y}">{html.escape(name)}</text>')
    return out


def layer_chart(result: dict) -> str:
    """Where each MoE layer's experts came from during decoding: device, RAM, SSD shares per layer."""
    layers = sorted(result["layers"], key=int)
    shares: dict[str, list[float]] = {"device": [], "RAM": [], "SSD": []}
    for layer in layers:
        c = result["layers"][layer]
        uses = c["uses"] or 1
        shares["device"].append(c["device"] / uses)
        shares["RAM"].append(c["ram"] / uses)
        shares["SSD"].append(max(uses - c["device"] - c["ram"], 0) / uses)
    return stacked_bars(
        [f"layer {n}" for n in layers],
        shares,
        [None] * len(layers),
        f"{result['preset']}: where each layer's experts came from (share of uses)",
        percent,
    )


def _fmt(key: str, value: object) -> str:
    if value is None:
        return "-"
    if key.startswith("peak") or key.endswith("budget"):
        return format_bytes(value)
    if isinstance(value, float):
        return f"{value:.1%}" if key.endswith("rate") or key == "efficiency" else f"{value:.4g}"
    return html.escape(str(value))


def page(meta: dict, results: list[dict]) -> str:
    labels = [r["preset"] for r in results]
    c = meta["ceilings"]
    facts = [
        ("commit", meta["commit"]),
        ("command", meta["command"]),
        ("model", meta["model"]),
        ("device", meta["device"]),
        ("date", meta["date"]),
        (
            "ceilings",
            f"HBM {c['hbm_read_gbps']:.0f} GB/s, host->GPU {c['pinned_h2d_gbps']:.1f} GB/s, "
            f"SSD random records {c['random_read_gbps']:.2f} GB/s, as the store reads "
            f"{c.get('store_read_gbps', 0.0):.2f} GB/s ({c['disk']})",
        ),
    ]
    keys = ("gpu_budget", "cpu_budget", "decode_mode", *CSV_FIELDS[1:13])
    rows = "".join(
        f"<tr><th>{html.escape(k)}</th>" + "".join(f"<td>{_fmt(k, r[k])}</td>" for r in results) + "</tr>" for k in keys
    )
    charts = [
        bar_chart(
            labels,
            {
                "decode tok/s": [r["decode_tok_s"] for r in results],
                "prefill tok/s": [r["prefill_tok_s"] for r in results],
            },
            "tokens per second",
            "tok/s",
        ),
        stacked_bars(
            labels,
            {
                "waiting for experts": [r["stall_s_per_token"] for r in results],
                "computing": [r["compute_s_per_token"] for r in results],
            },
            [r["floor_s_per_token"] for r in results],
            "a decode token's time, against its floor",
        ),
        *(layer_chart(r) for r in results),
    ]
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>dsfp4 bench</title>"
        "<style>body{font-family:sans-serif;margin:2em} td,th{padding:2px 10px;text-align:right}"
        " th{text-align:left}</style></head><body><h1>dsfp4 bench</h1><table>"
        + "".join(f"<tr><th>{k}</th><td style='text-align:left'>{html.escape(str(v))}</td></tr>" for k, v in facts)
        + "</table><h2>Results</h2><table><tr><th></th>"
        + "".join(f"<th>{html.escape(x)}</th>" for x in labels)
        + f"</tr>{rows}</table><h2>Charts</h2>"
        + "".join(f"<div>{svg}</div>" for svg in charts)
        + "</body></html>\n"
    )
