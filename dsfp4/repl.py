"""`dsfp4 run MODEL --chat`: a line-editing chat loop (readline history) with a few slash commands."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

from dsfp4.errors import DsfpError
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.stats import GenerationStats
from dsfp4.runtime.tokenizer import split_reasoning

HELP = """/stats   numbers of the last answer (tokens, TTFT, tok/s, expert tiers, bytes moved, peaks)
/reset   forget the conversation (and its cache)
/help    this text
/quit    leave (Ctrl-D works too)"""


def chat_repl(
    engine: Engine,
    system: str | None = None,
    read: Callable[[str], str] = input,
    write: Callable[[str], None] = sys.stdout.write,
) -> None:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (gives input() line editing and an up-arrow history)
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    last: GenerationStats | None = None  # of this conversation's last answer
    write("dsfp4 chat: /help lists the commands\n")
    while True:
        try:
            line = read("> ")
        except EOFError:
            write("\n")
            return
        except KeyboardInterrupt:
            write("\n")
            continue
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/quit", "/exit"):
            return
        if cmd.startswith("/"):
            if cmd == "/help":
                write(HELP + "\n")
            elif cmd == "/reset":
                messages, last = list(base), None
                engine.reset()
                write("(conversation cleared)\n")
            elif cmd == "/stats":
                write((last.table() if last else "(nothing generated yet)") + "\n")
            else:
                write(f"unknown command {cmd}; /help lists them\n")
            continue
        messages.append({"role": "user", "content": line})
        try:
            stream = engine.stream(messages)
            for delta in stream:
                write(delta.text)
            write("\n")
            last = stream.generation.stats
            # history keeps the answer without R1-style thinking, as DeepSeek's templates expect
            messages.append({"role": "assistant", "content": split_reasoning(stream.generation.text)[1]})
        except KeyboardInterrupt:
            write("\n(interrupted)\n")
            messages.pop()
        except (DsfpError, ValueError, RuntimeError) as e:  # one bad turn must not end the conversation
            write(f"error: {e}\n")
            messages.pop()
