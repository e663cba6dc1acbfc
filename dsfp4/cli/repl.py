"""The chat loop of `dsfp4 run MODEL --chat` and `dsfp4 chat --url URL`: line editing (readline history),
slash commands, and R1-style thinking shown or hidden (/think). The loop talks to a ChatBackend: the local
engine (LocalChat) or a server (chat_client.RemoteChat); everything else is shared."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Protocol

from dsfp4.errors import DsfpError
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.generate.reasoning import ReasoningSplitter
from dsfp4.runtime.generate.stats import GenerationStats

HELP = """/stats   numbers of the last answer (tokens, TTFT, tok/s, expert tiers, bytes moved, peaks)
/think   turn the model's thinking on or off (DeepSeek-V4, V3.1); where its format has no switch (R1 always
         thinks), show or hide it
/reset   forget the conversation (and its cache)
/help    this text
/quit    leave (Ctrl-D works too)"""


class ChatBackend(Protocol):
    # of the last finished reply
    last: GenerationStats | None
    # the model's prompt format turns thinking on and off
    thinking_switch: bool
    # the switch, for the next replies (None: the format's default)
    thinking: bool | None

    def reply(self, messages: list[dict[str, str]]) -> Iterator[tuple[str, str]]:
        """(thinking, answer) pieces of the next assistant turn, as they are produced."""
        ...

    def reset(self) -> None: ...


class LocalChat:
    """The loop's backend on a loaded engine."""

    def __init__(self, engine: Engine):
        self.engine, self.last = engine, None
        self.thinking_switch, self.thinking = engine.tokenizer.thinking_switch, engine.options.thinking

    def reply(self, messages: list[dict[str, str]]) -> Iterator[tuple[str, str]]:
        ids = self.engine.encode(messages, thinking=self.thinking)
        splitter = ReasoningSplitter(self.engine.opens_thinking(ids))
        stream = self.engine.stream(ids)
        for delta in stream:
            yield splitter.feed(delta.text)
        yield splitter.flush()
        self.last = stream.generation.stats

    def reset(self) -> None:
        self.engine.reset()


def _answer(backend: ChatBackend, messages: list[dict[str, str]], show: bool, write: Callable[[str], None]) -> str:
    """Stream one reply to the terminal; returns the answer without the thinking."""
    # None: no thinking yet; False: inside it; True: closed
    answer, thought = [], None
    for thinking, text in backend.reply(messages):
        if thinking and thought is None:
            thought = False
            write("<think>\n" if show else "(thinking; /think shows it)\n")
        if thinking and show:
            write(thinking)
        if text and thought is False:
            thought = True
            write("\n</think>\n\n" if show else "")
        if text:
            write(text)
            answer.append(text)
    write("\n")
    return "".join(answer)


def _echo(text: str) -> None:
    """Write to the stdout of the moment (tests swap it), at once: answers stream in without newlines."""
    sys.stdout.write(text)
    sys.stdout.flush()


def chat_repl(
    backend: ChatBackend,
    system: str | None = None,
    read: Callable[[str], str] = input,
    write: Callable[[str], None] = _echo,
) -> None:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (gives input() line editing and an up-arrow history)
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    # of this conversation's last answer
    last: GenerationStats | None = None
    show_thinking = True
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
                backend.reset()
                write("(conversation cleared)\n")
            elif cmd == "/stats":
                write((last.table() if last else "(nothing generated yet)") + "\n")
            elif cmd == "/think" and backend.thinking_switch:
                # the format's switch: the model thinks or not
                backend.thinking = not backend.thinking
                show_thinking = True
                write(f"(thinking {'on: the model thinks before it answers' if backend.thinking else 'off'})\n")
            elif cmd == "/think":
                # no switch: the model thinks as its format says; only the display changes
                show_thinking = not show_thinking
                write(f"(this model has no thinking switch; its thinking {'shown' if show_thinking else 'hidden'})\n")
            else:
                write(f"unknown command {cmd}; /help lists them\n")
            continue
        messages.append({"role": "user", "content": line})
        try:
            answer = _answer(backend, messages, show_thinking, write)
            last = backend.last
            # history keeps the answer without R1-style thinking, as DeepSeek's templates expect
            messages.append({"role": "assistant", "content": answer})
        except KeyboardInterrupt:
            write("\n(interrupted)\n")
            messages.pop()
        except (DsfpError, ValueError, RuntimeError) as e:
            # one bad turn must not end the conversation
            write(f"error: {e}\n")
            messages.pop()
