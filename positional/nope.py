"""NoPE: no position information at all; the causal mask is the only source of order."""

from __future__ import annotations

import dataclasses

from positional.scheme import Scheme


@dataclasses.dataclass(frozen=True)
class NoPE(Scheme):
    pass
