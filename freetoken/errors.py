"""The error types freetoken raises on purpose.

Every error a user can cause (a bad checkpoint, a bad request) is one of these, with a message
that names what is wrong; the server maps them to its API's error schema.
"""

from __future__ import annotations


class FreetokenError(Exception):
    """Base of all errors freetoken raises deliberately."""


class CheckpointError(FreetokenError):
    """A checkpoint directory cannot be loaded (unknown architecture, missing or misshapen tensor)."""


class ConfigError(FreetokenError):
    """The engine's own settings cannot work (a zero context length, no request rows, ...)."""


class RequestError(FreetokenError):
    """A request is invalid (bad sampling parameters, prompt too long, ...). Maps to HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineError(FreetokenError):
    """The engine failed while serving a request (an actor crashed). Maps to HTTP 500."""
