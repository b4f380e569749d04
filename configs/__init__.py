"""The one grammar of a config file's argument, `--config configs/X.py:ARG`.

ARG is slash-separated positional fields, e.g. `configs/sessa.py:symbolsoup/sessa/1`; trailing
fields may be left out (an empty field is also its default). Each config file declares its
fields once, as FIELDS, a tuple of (name, default, valid) where valid is

  - a collection of the accepted strings,
  - `int`: a non-negative integer (a seed, say), returned as an int,
  - SCHEME: any registered position scheme name ("+" adding score biases, as the registry reads it),
  - a function of the fields before it (a dict) returning one of the above, where the valid
    values depend on an earlier field (configs/tapa.py: the methods of a stage).

Scheme names never contain "/", so a scheme is one field.
"""

from __future__ import annotations

import os
import types

from models import registry

SCHEME = "SCHEME"


def _check(value: str, valid) -> tuple[bool, str]:
    """(whether value is valid, the valid values in words)."""
    if valid is int:
        return value.isdigit(), "a non-negative integer"
    if valid is SCHEME:
        try:
            registry.parts(value)  # every part of "a+b" must be registered
        except ValueError:
            return False, f"a registered scheme, '+' adding a bias: {', '.join(sorted(registry.REGISTRY))}"
        return True, ""
    return value in valid, ", ".join(valid)


def parse_arg(path: str, arg: str | None, fields: tuple) -> dict:
    """The fields of `arg` by name, defaults filled in; one-line ValueError on bad input.

    path: the config file (its `__file__`), named in the error.
    """
    grammar = "/".join(name.upper() for name, _, _ in fields)
    defaults = "/".join(str(default) for _, default, _ in fields)
    where = f"configs/{os.path.basename(path)}:{arg}"
    given = arg.split("/") if arg else []
    if len(given) > len(fields):
        raise ValueError(f"{where}: {len(given)} fields, at most {len(fields)}; the argument is "
                         f"{grammar} (default {defaults})")
    out = {}
    for i, (name, default, valid) in enumerate(fields):
        value = given[i] if i < len(given) and given[i] else str(default)
        if isinstance(valid, types.FunctionType):
            valid = valid(out)
        ok, described = _check(value, valid)
        if not ok:
            raise ValueError(f"{where}: {name} {value!r} is not valid (valid: {described}); the argument "
                             f"is {grammar} (default {defaults})")
        out[name] = int(value) if valid is int else value
    return out
