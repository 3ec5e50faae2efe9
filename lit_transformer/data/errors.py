"""The one exception the data pipeline raises for bad input or bad settings.

Every message is one line and names the file, key or value at fault, so that a user can fix
the recipe without reading a traceback.
"""

from __future__ import annotations


class DataError(ValueError):
    """Bad data or data settings: a missing path, an empty or binary file, a missing column, ..."""
