"""Typed errors. The library raises them; the CLI turns each into one line and a non-zero exit."""

from __future__ import annotations


class DsfpError(Exception):
    """Base class: the message names the file, tensor or flag at fault and the fix."""


class ConfigError(DsfpError):
    """config.json (or a runtime option) is missing a field or holds an unsupported value."""


class ContextLengthError(ConfigError):
    """A prompt that leaves no room in the context: `tokens` of it against a context of `context`."""

    def __init__(self, message: str, tokens: int, context: int):
        super().__init__(message)
        self.tokens, self.context = tokens, context


class FormatError(DsfpError):
    """A tensor cannot be encoded or decoded in the requested format (NaN, bad shape, bad scale)."""


class SourceError(DsfpError):
    """The source checkpoint is incomplete or inconsistent (missing shard, truncated file, odd tensor)."""


class OutputError(DsfpError):
    """The output location cannot be used (exists, not enough disk, interrupted by another plan)."""


class ManifestError(DsfpError):
    """manifest.json is missing, of another version, or does not describe the files beside it."""


class ChecksumError(DsfpError):
    """A file or expert record does not match the checksum recorded in the manifest."""
