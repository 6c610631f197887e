"""Errors every layer may raise about the user's settings."""

from __future__ import annotations


class UsageError(ValueError):
    """A bad combination of flags, named in the message."""
