"""Lists of typed entries in a recipe (`tasks:`, `eval:`): each mapping is checked on its own, so
that an error names the file and the entry (`tasks[1] (clm)`) as well as the key; OmegaConf names
a key inside a list without its index. Nothing here imports torch.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Callable, Iterator
from typing import Any, Literal

from omegaconf import OmegaConf
from omegaconf import errors as oc_errors

from lit_transformer.errors import RecipeError, closest, first_line


def literal_of(hint: Any) -> Any:
    """The Literal inside Optional[Literal[...]] (or the hint itself); None for any other hint."""
    if typing.get_origin(hint) is Literal:
        return hint
    return next((arg for arg in typing.get_args(hint) if typing.get_origin(arg) is Literal), None)


def list_entries(entries: Any, source: str, section: str, example: str, what: str) -> Iterator[tuple[str, dict]]:
    """(where, mapping) for each entry of a `section:` list: `where` is `section[i] (name)`.
    `example` shows the list's form and `what` an entry's, for the errors."""
    if not isinstance(entries, list):
        raise RecipeError(f"{source}: {section}: expected a list, e.g. {example}")
    for index, entry in enumerate(entries):
        where = f"{section}[{index}]"
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            where += f" ({entry['name']})"
        if not isinstance(entry, dict):
            raise RecipeError(f"{source}: {where}: {what}, got {entry!r}")
        yield where, entry


def build_entry(
    cls: type,
    entry: dict,
    source: str,
    where: str,
    keys: list[str],
    *,
    public: Callable[[str], str] = str,
    checks: tuple[type[Exception], ...] = (RecipeError,),
    named: str = "",
) -> Any:
    """`cls` from one entry through OmegaConf (types and unknown keys checked); its errors as one
    line naming the entry and the key: the closest of `keys` for an unknown one, the allowed values
    of a Literal field. `public` turns OmegaConf's key into the name a user writes. The errors
    `checks` that cls's own checks raise are put behind `where` too, with their own name of the
    entry (`named`, e.g. `eval.held`) taken off the front."""
    try:
        # unsafe_merge: the structured config is built here for this entry alone (merge would copy it)
        return OmegaConf.to_object(OmegaConf.unsafe_merge(OmegaConf.structured(cls), entry))
    except checks as error:
        message = first_line(error)
        if named:
            for lead in (named + ".", named + ": "):
                message = message.removeprefix(lead)
        raise RecipeError(f"{source}: {where}: {message}") from None
    except oc_errors.OmegaConfBaseException as error:
        key = public(getattr(error, "full_key", "") or "")
        if isinstance(error, oc_errors.ConfigKeyError):
            match = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
            hint = f" (did you mean `{match[0]}`?)" if match else ""
            raise RecipeError(f"{source}: {where}: unknown key {key}{hint}") from None
        if isinstance(error, oc_errors.MissingMandatoryValue):
            raise RecipeError(f"{source}: {where}: missing value for {key}") from None
        allowed = typing.get_args(literal_of(typing.get_type_hints(cls).get(key)))
        if allowed:
            value = entry.get(key)
            raise RecipeError(
                f"{source}: {where}: {key}={value!r} is not one of {list(allowed)}{closest(str(value), allowed)}"
            ) from None
        message = first_line(error).split(" Did you mean")[0]
        if "is not a ListConfig" in message:
            message = "expected a list, e.g. [a, b]"
        raise RecipeError(f"{source}: {where}: {key}: {message}" if key else f"{source}: {where}: {message}") from None
