"""Data: TFDS builders, tokenizers, packing and grain loaders.

Kept light on purpose: importing `data` pulls in neither TFDS nor grain; import
`data.pipeline` (loaders), `data.local_text` (builders) or `data.tokenizers` for those.
"""

import os
from typing import Iterable

from data.config import default_data_config


class DataError(Exception):
    """A data set or source that cannot be used as configured; the message says what to do."""


def absent_dirs(path: str) -> list[str]:
    """`path` and those of its ancestors that do not exist yet: what `os.makedirs(path)` would create."""
    path, out = os.path.abspath(path), []
    while not os.path.exists(path):
        out.append(path)
        path = os.path.dirname(path)
    return out


def remove_empty_dirs(dirs: Iterable[str]) -> None:
    """Removes those of `dirs` that are empty, deepest first (so a folder emptied by removing its
    child goes too); a folder with anything in it, or already gone, is left alone. Clean-up of a
    failed preparation: pass it `absent_dirs` taken before, never folders that existed already.
    """
    for path in sorted(set(dirs), key=len, reverse=True):
        try:
            os.rmdir(path)
        except OSError:
            pass


__all__ = ["DataError", "absent_dirs", "default_data_config", "remove_empty_dirs"]
