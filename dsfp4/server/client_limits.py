"""What the server takes of a client before the app reads a request, and how long it waits for it: the command line
reads these for its flags' defaults (no server library imported)."""

from __future__ import annotations

# a token's text in JSON at the most: a character that is a token of its own escaped as \uXXXX is 6 bytes, and the
# long tokens (runs of spaces, code) 8-16; a prompt of token ids ("123456, ") takes 8
BYTES_PER_TOKEN = 16
# the rest of a body: roles and fields, tools' descriptions, a json_schema (not part of the prompt)
ENVELOPE_BYTES = 1 << 20
# a request's head within this of its first byte, its body within this of its head: the largest default body (V3's
# context of 163,840 tokens: 3.5 MiB) at 0.5 Mbit/s
READ_TIMEOUT_S = 60.0
# a request's head at most: h11, uvicorn's other parser, refuses one past 16 KiB; an OpenAI client's, its bearer key
# among them, is well under 2 KiB
HEAD_BYTES = 64 << 10


def default_max_body(max_context: int) -> int:
    """The body limit for a server of `max_context` tokens: every token at BYTES_PER_TOKEN, and the envelope."""
    return max_context * BYTES_PER_TOKEN + ENVELOPE_BYTES
