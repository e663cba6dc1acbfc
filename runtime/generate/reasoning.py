"""R1-style thinking: the part of an answer between <think> and </think>, split from the answer as the text
streams in (the server's `reasoning_content`, the chat loop's /think).

R1's chat template ends the prompt with "<think>\\n", so the output starts inside the thinking block and only
closes it; other models may open the block themselves. Which case holds is known from the prompt.
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"


def opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves the model inside a thinking block (R1's templates do)."""
    return prompt_text.rstrip().endswith(THINK_START)


def partial_suffix(text: str, tag: str, whole: bool = False) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (it may become the tag); with
    `whole`, the whole tag counts too."""
    return max((k for k in range(1, len(tag) + whole) if text.endswith(tag[:k])), default=0)


class ReasoningSplitter:
    """Feed text pieces in order; each feed returns the (reasoning, answer) text that is now certain. Text that
    may still be a tag waits. Whitespace right after a tag is dropped, as R1's output puts a newline there."""

    def __init__(self, thinking: bool):
        # start, think_start, think, answer_start, answer
        self.state = "think_start" if thinking else "start"
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = ""
        # does the output open a thinking block itself?
        if self.state == "start":
            head = self.buf.lstrip()
            if len(head) < len(THINK_START) and THINK_START.startswith(head):
                return "", ""
            if head.startswith(THINK_START):
                self.buf, self.state = head[len(THINK_START) :], "think_start"
            else:
                self.state = "answer"
        if self.state == "think_start":
            self.buf = self.buf.lstrip()
            if self.buf:
                self.state = "think"
        if self.state == "think":
            end = self.buf.find(THINK_END)
            if end < 0:
                keep = partial_suffix(self.buf, THINK_END)
                reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                return reasoning, ""
            reasoning, self.buf, self.state = self.buf[:end], self.buf[end + len(THINK_END) :], "answer_start"
        if self.state == "answer_start":
            self.buf = self.buf.lstrip()
            if self.buf:
                self.state = "answer"
        answer = ""
        if self.state == "answer":
            answer, self.buf = self.buf, ""
        return reasoning, answer

    def flush(self) -> tuple[str, str]:
        """What is left when the text ends: an unfinished tag is text after all."""
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state in ("think_start", "think") else ("", rest)


def split_reasoning(text: str, thinking: bool) -> tuple[str, str]:
    """The whole (reasoning, answer) of a finished text, exactly as the streamed pieces add up."""
    splitter = ReasoningSplitter(thinking)
    parts = [splitter.feed(text), splitter.flush()]
    return "".join(p[0] for p in parts), "".join(p[1] for p in parts)
