"""`dsfp4 demo`: the whole path on a tiny model, offline (dsfp4/tools/demo.py)."""

from __future__ import annotations

from pathlib import Path

import click

from dsfp4.cli.options import PATH


@click.command()
@click.option(
    "--dir", "workdir", type=PATH, help="Keep the demo's checkpoint and model here (default: a temporary folder)."
)
@click.option("--prompt", default=None, help="What to ask the tiny model.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=24, show_default=True)
@click.option(
    "--family", type=click.Choice(["v3", "v4"]), default="v3", show_default=True, help="DeepSeek-V3 or DeepSeek-V4."
)
def demo(workdir: Path | None, prompt: str | None, device: str, max_tokens: int, family: str) -> None:
    """Build a tiny DeepSeek-V3 (or --family v4) checkpoint, convert it, verify it and run a prompt: offline,
    end to end."""
    import tempfile

    from dsfp4.tools.demo import DEMO_PROMPT, run_demo

    with tempfile.TemporaryDirectory(prefix="dsfp4-demo-") as tmp:
        g = run_demo(
            workdir or Path(tmp),
            prompt or DEMO_PROMPT,
            device,
            max_tokens,
            echo=lambda line: click.echo(line, err=True),
            on_text=lambda t: click.echo(t, nl=False),
            family=family,
        )
        click.echo()
    click.echo(f"[{g.finish_reason}] {g.stats.line()}", err=True)
