"""Errors a user can cause, at the bottom of the package so every layer can raise them."""

from __future__ import annotations


class OptionError(ValueError):
    """A bad option or argument value. ``option`` is its Python name (``top_p``), so the CLI can name its flag
    (``--top-p``) instead; ``message`` is the rest (``must be in (0, 1], got 2.0``)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option} {message}")
        self.option, self.message = option, message


class Cancelled(Exception):
    """A request's client went away while its prompt ran: its forwards stopped between prompt chunks (a long prefill
    would otherwise hold its place for seconds with nobody to read the answer)."""
