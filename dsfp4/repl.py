"""`dsfp4 run MODEL --chat`: a line-editing chat loop (readline history) with a few slash commands."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

from dsfp4.errors import DsfpError
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.session import Generation, Session
from dsfp4.runtime.tokenizer import split_reasoning

HELP = """/stats   numbers of the last answer (tokens, TTFT, tok/s, expert tiers, bytes moved, peaks)
/reset   forget the conversation (and its cache)
/help    this text
/quit    leave (Ctrl-D works too)"""


def chat_repl(
    session: Session,
    options: RunOptions,
    system: str | None = None,
    read: Callable[[str], str] = input,
    write: Callable[[str], None] = sys.stdout.write,
) -> None:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (gives input() line editing and an up-arrow history)
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    last: Generation | None = None
    sampling = options.sampling()
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
                session.reset()
                write("(conversation cleared)\n")
            elif cmd == "/stats":
                write((last.stats.table() if last else "(nothing generated yet)") + "\n")
            else:
                write(f"unknown command {cmd}; /help lists them\n")
            continue
        messages.append({"role": "user", "content": line})
        try:
            ids = session.tokenizer.encode_chat(messages)
            last = session.generate(ids, options.max_tokens, sampling, options.stop, on_text=write)
            write("\n")
            # history keeps the answer without R1-style thinking, as DeepSeek's templates expect
            messages.append({"role": "assistant", "content": split_reasoning(last.text)[1]})
        except KeyboardInterrupt:
            write("\n(interrupted)\n")
            messages.pop()
        except (DsfpError, ValueError, RuntimeError) as e:  # one bad turn must not end the conversation
            write(f"error: {e}\n")
            messages.pop()
