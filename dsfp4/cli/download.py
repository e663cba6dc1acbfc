"""`dsfp4 download`: fetch a checkpoint from the Hugging Face hub, with a dry run and one progress bar."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from tqdm import tqdm

from dsfp4.cli.options import PATH, hub_options, quiet_option


@click.command()
@click.argument("repo_id")
@hub_options()
@click.option("--local-dir", type=PATH, help="Put the files in this folder (default: the Hugging Face cache).")
@click.option("--include", multiple=True, help="Glob of files to fetch (repeatable; default: what convert reads).")
@click.option("--exclude", multiple=True, help="Glob of files to leave out (repeatable).")
@click.option("--no-mtp", is_flag=True, help="Leave out shards that hold only the MTP layer (then convert --no-mtp).")
@click.option(
    "--dry-run",
    is_flag=True,
    help="List the files, their sizes and the free disk, and stop (--no-mtp fetches config and index first).",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Hash again every file an earlier run fetched and checked, not only those whose size or mtime changed "
    "since (the record in .dsfp4-download.json); a file that fails is fetched again.",
)
@quiet_option
def download(
    repo_id: str,
    revision: str,
    local_dir: Path | None,
    include: tuple[str, ...],
    exclude: tuple[str, ...],
    no_mtp: bool,
    dry_run: bool,
    verify: bool,
    token: str | None,
    quiet: bool,
) -> None:
    """Fetch REPO_ID (e.g. deepseek-ai/DeepSeek-V3) from the hub: the files `dsfp4 convert` needs, at one
    commit, each checked against the hub's size and sha256. Run it again to resume: files already here are kept while
    their size and mtime are the ones recorded when they were checked, hashed again when either changed, and fetched
    again when that fails.

    \b
    Examples:
      dsfp4 download deepseek-ai/DeepSeek-V3 --local-dir hf/DeepSeek-V3 --dry-run
      dsfp4 download deepseek-ai/DeepSeek-R1 --local-dir hf/DeepSeek-R1 --no-mtp
    """
    from dsfp4.convert.source.checkpoint import source_selection
    from dsfp4.hub.download import download as run_download
    from dsfp4.hub.download import plan_download

    plan = plan_download(repo_id, revision, local_dir, source_selection(include, no_mtp), exclude, token, verify=verify)
    if dry_run:
        click.echo(plan.table())
        return
    click.echo(plan.table(), err=True)
    with tqdm(
        total=plan.need + plan.partial,
        # what earlier runs fetched
        initial=plan.partial,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=quiet,
        file=sys.stderr,
        desc="download",
    ) as bar:
        target = run_download(plan, token, bar.update, lambda name: bar.set_postfix_str(name))
    click.echo(str(target))
