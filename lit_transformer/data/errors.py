"""The one exception the data pipeline raises for bad input or bad settings.

Every message is one line and names the file, key or value at fault, so that a user can fix
the recipe without reading a traceback.
"""

from __future__ import annotations

import difflib


class DataError(ValueError):
    """Bad data or data settings: a missing path, an empty or binary file, a missing column, ..."""


def closest(name: str, valid) -> str:
    """' (did you mean `x`?)' for the nearest valid name, or '' when nothing is close."""
    match = difflib.get_close_matches(str(name), [str(v) for v in valid], n=1, cutoff=0.5)
    return f" (did you mean `{match[0]}`?)" if match else ""
