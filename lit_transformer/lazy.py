"""Lazy exports (PEP 562) for a package's `__init__`: its public names are imported on first use.

So that `import lit_transformer` (and the command line's `--help` and `info`) loads neither
torch nor Lightning until a name that needs them is touched. A leaf: it imports nothing from
the package.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, where `exports` maps a public name to the
    submodule (relative to the package) that defines it."""
    namespace = import_module(package).__dict__

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f"{package}.{exports[name]}"), name)
        namespace[name] = value  # later look-ups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
