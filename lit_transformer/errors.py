"""The user errors that several layers raise, each shown as one line (`error: ...`, exit 2).

A leaf: it imports nothing from the package, so every layer may import it. The bottom layers
share the message helpers below; the model keeps its own `model.config.ConfigError`.
"""

from __future__ import annotations

import difflib


class RecipeError(ValueError):
    """A recipe cannot be read: the one-line message names the file and the key."""


class DataError(ValueError):
    """Bad data or data settings: a missing path, an empty or binary file, a missing column, ...
    One line naming the file, key or value at fault, so that a user can fix the recipe without
    reading a traceback."""


class RunError(ValueError):
    """A run directory, checkpoint or model source cannot be used; the message says why."""


def closest(name: object, valid) -> str:
    """' (did you mean `x`?)' for the nearest valid name, or '' when nothing is close."""
    match = difflib.get_close_matches(str(name), [str(v) for v in valid], n=1, cutoff=0.5)
    return f" (did you mean `{match[0]}`?)" if match else ""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): the part
    of a third-party error that fits in our one-line messages."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
