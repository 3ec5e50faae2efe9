"""The user errors that several layers raise, each shown as one line (`error: ...`, exit 2).

A leaf: it imports nothing from the package. The bottom layers keep their own error types
(`model.config.ConfigError`, `data.errors.DataError`), since they import nothing from above.
"""

from __future__ import annotations


class RecipeError(ValueError):
    """A recipe cannot be read: the one-line message names the file and the key."""


class RunError(ValueError):
    """A run directory, checkpoint or model source cannot be used; the message says why."""
