"""The one error type of the optimization toolkit: messages name the file, input or node."""

from __future__ import annotations


class OptimizeError(Exception):
    """A user-facing failure: bad file, bad data, unsupported operator, missed budget."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
