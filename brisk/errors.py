"""The user-error types: what brisk raises when the input, not brisk, is wrong.

Every message says what was wrong and what to do. Both are ValueErrors, so code that catches
ValueError keeps working; the server answers 400 only for these, and a ValueError of any other
origin (a library's, a bug's) is an internal error (500), not the user's fault.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input from a user: a request, an option, a file, a configuration."""


class InvalidRequest(UserError):
    """A bad request field: `param` names it (a server answers 400 with it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
