"""The `dsfp4` command: a thin Click shell over library functions.

Library errors (DsfpError) become one line on stderr and exit status 1; `--debug` (or DSFP4_DEBUG=1)
shows the traceback instead. Results go to stdout, progress and notes to stderr.
"""

from __future__ import annotations

import errno

import click

from dsfp4.cli.bench import bench, doctor
from dsfp4.cli.convert import convert, inspect, verify
from dsfp4.cli.demo import demo
from dsfp4.cli.download import download
from dsfp4.cli.profile import profile_hot
from dsfp4.cli.run import chat, run
from dsfp4.device import use_expandable_segments
from dsfp4.errors import DsfpError
from dsfp4.version import __version__


def _os_error_line(e: OSError) -> str:
    where = f": {e.filename}" if e.filename else ""
    hint = "; free some space and run the same command again (it resumes)" if e.errno == errno.ENOSPC else ""
    return f"{e.strerror or e}{where}{hint}"


class DsfpGroup(click.Group):
    """Turns library errors (and the OS's: permissions, full disk) into one line and exit status 1."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (DsfpError, OSError) as e:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"error: {_os_error_line(e) if isinstance(e, OSError) else e}", err=True)
            ctx.exit(1)


@click.group(cls=DsfpGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, envvar="DSFP4_DEBUG", help="Show tracebacks on errors.")
@click.version_option(__version__, prog_name="dsfp4")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Run DeepSeek's big MoE models on one GPU: FP4 experts, tiered expert store, Triton kernels."""
    ctx.obj = {"debug": debug}


for command in (convert, inspect, verify, run, chat, profile_hot, download, bench, doctor, demo):
    cli.add_command(command)


def main() -> None:
    use_expandable_segments()  # before any tensor: the device budget relies on it (dsfp4/device.py)
    cli(prog_name="dsfp4")


if __name__ == "__main__":
    main()
