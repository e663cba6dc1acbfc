"""The `dsfp4` command: a thin Click shell over library functions.

Library errors (DsfpError) become one line on stderr and exit status 1; `--debug` (or DSFP4_DEBUG=1)
shows the traceback instead. Results go to stdout, progress and notes to stderr.
"""

from __future__ import annotations

import errno
import importlib
import os
import sys

import click

from dsfp4.allocator import use_expandable_segments
from dsfp4.cli.progress import show_stages
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


# name -> (module:function, the short help `dsfp4 --help` lists): a command's module, and torch with it, is imported
# only when that command runs or shows its own help (tests/dsfp4/test_cli.py checks the table)
COMMANDS = {
    "bench": ("dsfp4.cli.bench:bench", "Measure MODEL end to end: TTFT, prefill and decode tok/s"),
    "chat": ("dsfp4.cli.run:chat", "Chat with a model served by `dsfp4 run MODEL --serve`"),
    "convert": ("dsfp4.cli.convert:convert", "Convert a Hugging Face DeepSeek checkpoint SRC"),
    "demo": ("dsfp4.cli.demo:demo", "Build, convert, verify and run a tiny DeepSeek checkpoint, offline"),
    "doctor": ("dsfp4.cli.bench:doctor", "Measure this machine's ceilings"),
    "download": ("dsfp4.cli.download:download", "Fetch REPO_ID (e.g. deepseek-ai/DeepSeek-V3) from the hub"),
    "eval": ("dsfp4.cli.eval:eval_command", "Perplexity of MODEL over a text in windows of --context tokens"),
    "export": ("dsfp4.cli.export:export", "Write the converted MODEL as another engine's checkpoint"),
    "inspect": ("dsfp4.cli.convert:inspect", "Show what a converted MODEL holds"),
    "profile-hot": ("dsfp4.cli.profile:profile_hot", "Measure which experts each MoE layer of MODEL uses"),
    "run": ("dsfp4.cli.run:run", "Generate with a converted MODEL: --prompt, --chat or --serve"),
    "verify": ("dsfp4.cli.convert:verify", "Re-hash every file and expert record of MODEL"),
}


def load_command(name: str) -> click.Command:
    """COMMANDS' command `name`, its module imported now."""
    module, attr = COMMANDS[name][0].split(":")
    return getattr(importlib.import_module(module), attr)


class DsfpGroup(click.Group):
    """Loads each command when it is asked for (COMMANDS); turns library errors (and the OS's: permissions, full
    disk) into one line and exit status 1, Ctrl-C into status 130 (with how to resume), a closed output pipe into a
    quiet exit; `--debug` may come anywhere."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return load_command(name) if name in COMMANDS else None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The group's help lists COMMANDS' short help without importing any command."""
        with formatter.section("Commands"):
            formatter.write_dl([(name, COMMANDS[name][1]) for name in self.list_commands(ctx)])

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


def main() -> None:
    # before any tensor: the device budget relies on it (dsfp4/device.py)
    use_expandable_segments()
    show_stages(sys.stderr)
    cli(prog_name="dsfp4")


if __name__ == "__main__":
    main()
