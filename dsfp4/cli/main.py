"""The `dsfp4` command: a thin Click shell over library functions.

Library errors (DsfpError) become one line on stderr and exit status 1; `--debug` (or DSFP4_DEBUG=1)
shows the traceback instead. Results go to stdout, progress and notes to stderr.
"""

from __future__ import annotations

import errno
import os
import sys

import click

from dsfp4.cli.bench import bench, doctor
from dsfp4.cli.convert import convert, inspect, verify
from dsfp4.cli.demo import demo
from dsfp4.cli.download import download
from dsfp4.cli.eval import eval_command
from dsfp4.cli.export import export
from dsfp4.cli.profile import profile_hot
from dsfp4.cli.progress import show_stages
from dsfp4.cli.run import chat, run
from dsfp4.device import use_expandable_segments
from dsfp4.errors import DsfpError
from dsfp4.version import __version__


def _os_error_line(e: OSError) -> str:
    where = f": {e.filename}" if e.filename else ""
    hint = "; free some space and run the same command again (it resumes)" if e.errno == errno.ENOSPC else ""
    return f"{e.strerror or e}{where}{hint}"


# 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
INTERRUPTED = 130
# 128 + SIGPIPE, as a command whose reader went away (`dsfp4 run ... | head`)
PIPE_CLOSED = 141
# what an interrupted command leaves, and how to go on
RESUMES = {
    "convert": "run the same command again to resume",
    "download": "run the same command again to resume",
    "export": "run the same command again to resume (the shards written whole are kept)",
    "profile-hot": "a --repack stops between layers; run the same command again to finish it",
}


class DsfpGroup(click.Group):
    """Turns library errors (and the OS's: permissions, full disk) into one line and exit status 1, Ctrl-C into
    status 130 (with how to resume), a closed output pipe into a quiet exit; `--debug` may come anywhere."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        end = args.index("--") if "--" in args else len(args)
        # `dsfp4 run model --debug ...` as well as `dsfp4 --debug run ...`
        if "--debug" in args[:end]:
            args = ["--debug", *(a for i, a in enumerate(args) if not (a == "--debug" and i < end))]
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> object:
        debug = bool(ctx.params.get("debug"))
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            if debug:
                raise
            name = ctx.invoked_subcommand or ""
            click.echo("\ninterrupted" + (f": {RESUMES[name]}" if name in RESUMES else ""), err=True)
            ctx.exit(INTERRUPTED)
        except BrokenPipeError:
            # stdout's reader is gone: nothing more can be said there; keep Python's exit flush from failing too
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(PIPE_CLOSED)
        except (DsfpError, OSError) as e:
            if debug:
                raise
            click.echo(f"error: {_os_error_line(e) if isinstance(e, OSError) else e}", err=True)
            ctx.exit(1)


@click.group(cls=DsfpGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, envvar="DSFP4_DEBUG", help="Show tracebacks on errors.")
@click.version_option(__version__, prog_name="dsfp4")
# --debug is DsfpGroup's to act on
def cli(debug: bool) -> None:
    """Run DeepSeek's big MoE models on one GPU: FP4 experts, tiered expert store, Triton kernels."""


for command in (convert, inspect, verify, run, chat, eval_command, profile_hot, download, bench, doctor, demo, export):
    cli.add_command(command)


def main() -> None:
    # before any tensor: the device budget relies on it (dsfp4/device.py)
    use_expandable_segments()
    show_stages(sys.stderr)
    cli(prog_name="dsfp4")


if __name__ == "__main__":
    main()
