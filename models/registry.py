"""The scheme registry: the one place every part of the codebase looks a scheme up by name.

An entry names the pure `Scheme` class from `positional/`, the options it fixes, and the NNX
module (if any) that computes the scheme's per-token features from the layer input. The
features module is built as `features(scheme, d_model, rngs=rngs)` and called as
`features(x) -> pytree` with x [B, T, d_model].

Adding a scheme: one file in `positional/`, a features module if it learns anything, and one
`register(...)` line here. The conformance suite in `tests/` then covers it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from positional.alibi import Alibi
from positional.nope import NoPE
from positional.rope import Rope
from positional.scheme import Scheme


@dataclasses.dataclass(frozen=True)
class Entry:
    scheme_cls: type[Scheme]
    fixed: dict[str, Any] = dataclasses.field(default_factory=dict)
    features: Callable[..., Any] | None = None
    doc: str = ""


REGISTRY: dict[str, Entry] = {}


def register(name: str, entry: Entry) -> None:
    if name in REGISTRY:
        raise ValueError(f"scheme {name!r} is already registered")
    REGISTRY[name] = entry


def get_entry(name: str) -> Entry:
    if name not in REGISTRY:
        raise ValueError(f"unknown position scheme {name!r}; registered schemes: "
                         f"{', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def make_scheme(name: str, *, num_heads: int, head_dim: int, **options) -> Scheme:
    """Build the named scheme with user options (e.g. RoPE's base, scaling, factor)."""
    entry = get_entry(name)
    fields = {f.name for f in dataclasses.fields(entry.scheme_cls)} - {"num_heads", "head_dim"}
    unknown = set(options) - fields
    if unknown:
        raise ValueError(f"scheme {name!r} has no option(s) {sorted(unknown)}; "
                         f"its options are: {sorted(fields - set(entry.fixed)) or 'none'}")
    fixed = set(options) & set(entry.fixed)
    if fixed:
        raise ValueError(f"scheme {name!r} fixes option(s) {sorted(fixed)}; choose another scheme")
    return entry.scheme_cls(num_heads=num_heads, head_dim=head_dim, **entry.fixed, **options)


register("nope", Entry(NoPE, doc="no position information"))
register("alibi", Entry(Alibi, doc="linear distance bias, standard slopes"))
register("rope", Entry(Rope, doc="rotary embedding; options: base, scaling (none/pi/ntk/yarn), "
                                 "factor, original_max_len, layout"))
register("rope_qkv", Entry(Rope, fixed={"rotate_values": True},
                           doc="rotary on q, k and v, head output rotated back"))
