"""Data: TFDS builders, tokenizers, packing and grain loaders.

Kept light on purpose: importing `data` pulls in neither TFDS nor grain; import
`data.pipeline` (loaders), `data.local_text` (builders) or `data.tokenizers` for those.
"""

from data.config import default_data_config


class DataError(Exception):
    """A data set or source that cannot be used as configured; the message says what to do."""


__all__ = ["DataError", "default_data_config"]
