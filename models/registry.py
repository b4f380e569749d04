"""The scheme registry: the one place every part of the codebase looks a scheme up by name.

An entry names the pure `Scheme` class from `positional/`, the options it fixes, and the NNX
module (if any) that computes the scheme's per-token features (see models/features.py for
how it is built and called).

A name may add score-bias schemes to a scheme with "+": "so2_learned_qkv+alibi" is the SO(2)
transport with ALiBi's bias on its logits. User options apply to the first scheme.

Adding a scheme: one file in `positional/`, a features module if it learns anything, and one
`register(...)` line here. The conformance suite in `tests/` then covers it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from models.features import EsprFeatures, ForgetGate, HouseholderVectors, MergedFeatures, StepAngles
from positional.alibi import Alibi
from positional.espr import Espr, EsprRF
from positional.fox import Fox
from positional.householder import Path
from positional.nope import NoPE
from positional.rope import Rope
from positional.scheme import Scheme
from positional.so2 import SO2
from positional.tapa import Tapa


@dataclasses.dataclass(frozen=True)
class Entry:
    scheme_cls: type[Scheme]
    fixed: dict[str, Any] = dataclasses.field(default_factory=dict)
    features: Callable[..., Any] | None = None
    doc: str = ""
    compose: tuple = ()  # score-bias schemes always added, as if written "name+bias"


REGISTRY: dict[str, Entry] = {}


def register(name: str, entry: Entry) -> None:
    if name in REGISTRY:
        raise ValueError(f"scheme {name!r} is already registered")
    REGISTRY[name] = entry


def get_entry(name: str) -> Entry:
    """The entry of a registered name; for "a+b", the entry of a (whose features the layer uses)."""
    first = name.split("+")[0]
    if first not in REGISTRY:
        raise ValueError(f"unknown position scheme {first!r}; registered schemes: "
                         f"{', '.join(sorted(REGISTRY))}")
    return REGISTRY[first]


def _addable(entry: Entry) -> bool:
    """Whether the entry may follow a "+": a bias-only scheme that composes nothing itself."""
    return entry.scheme_cls.bias_only and not entry.compose


def parts(name: str) -> list[Entry]:
    """The entries of every part of a name, the first part first, then those it composes and
    those added with "+"."""
    first = get_entry(name)
    return [first] + [get_entry(part) for part in (*first.compose, *name.split("+")[1:])]


def config_defaults(name: str) -> dict:
    """The model config fields the scheme's parts set by default (their `config_defaults`); the
    first part's win."""
    out = {}
    for entry in reversed(parts(name)):
        out.update(entry.scheme_cls.config_defaults)
    return out


def _options(entry: Entry) -> set:
    return {f.name for f in dataclasses.fields(entry.scheme_cls)} - {"num_heads", "head_dim", "biases"}


def make_scheme(name: str, *, num_heads: int, head_dim: int, **options) -> Scheme:
    """Build the named scheme with user options (e.g. RoPE's base, scaling, factor). An option
    that the first part lacks goes to the added score-bias parts that have it ("path_fox" with
    gate_bias sets FoX's)."""
    first, *added = name.split("+")
    entry = get_entry(first)
    added = [*entry.compose, *added]
    fields = _options(entry)
    part_fields = {part: _options(get_entry(part)) for part in added}
    unknown = set(options) - fields - set().union(*part_fields.values())
    if unknown:
        valid = sorted(fields - set(entry.fixed)) + [o for p in added for o in sorted(part_fields[p])]
        raise ValueError(f"scheme {name!r} has no option(s) {sorted(unknown)}; "
                         f"its options are: {valid or 'none'}")
    fixed = set(options) & set(entry.fixed)
    if fixed:
        raise ValueError(f"scheme {first!r} fixes option(s) {sorted(fixed)}; choose another scheme")
    biases = []
    for part in added:
        part_entry = get_entry(part)
        if not _addable(part_entry):
            raise ValueError(f"{name!r}: only score-bias schemes can be added with '+', and {part!r} "
                             f"is not one; bias-only schemes: "
                             f"{', '.join(n for n, e in sorted(REGISTRY.items()) if _addable(e))}")
        mine = {k: v for k, v in options.items() if k not in fields and k in part_fields[part]}
        biases.append(make_scheme(part, num_heads=num_heads, head_dim=head_dim, **mine))
    return entry.scheme_cls(num_heads=num_heads, head_dim=head_dim, biases=tuple(biases),
                            **entry.fixed, **{k: v for k, v in options.items() if k in fields})


def make_features(name: str, scheme: Scheme, cfg, *, rngs):
    """The features module of a layer: the first part's and each added bias's, one dict out."""
    modules = [e.features(s, cfg, rngs=rngs) for e, s in zip(parts(name), (scheme, *scheme.biases))
               if e.features is not None]
    if len(modules) <= 1:
        return modules[0] if modules else None
    return MergedFeatures(modules)


register("nope", Entry(NoPE, doc="no position information"))
register("alibi", Entry(Alibi, doc="linear distance bias, standard slopes"))
register("rope", Entry(Rope, doc="rotary embedding; options: base, scaling (none/pi/ntk/yarn), "
                                 "factor, original_max_len, layout"))
register("rope_qkv", Entry(Rope, fixed={"rotate_values": True},
                           doc="rotary on q, k and v, head output rotated back"))
for _steps in ("random", "learned", "hidden"):
    for _qkv in (False, True):
        register(f"so2_{_steps}_{'qkv' if _qkv else 'qk'}",
                 Entry(SO2, fixed={"steps": _steps, "rotate_values": _qkv}, features=StepAngles,
                       doc=f"accumulated SO(2) transport, {_steps} step angles, "
                           f"{'q/k/v' if _qkv else 'q/k'}"))
register("tapa", Entry(Tapa, doc="token-aware phase attention (quadratic phase); options: alpha, theta, "
                                 "block_q, block_k (Pallas tiles)"))
register("tapa_linear", Entry(Tapa, fixed={"phase": "linear"}, doc="TAPA with the linear-phase ablation"))
register("espr", Entry(Espr, features=EsprFeatures,
                       doc="ESPR/STRING rotations: learned commuting generators (beta, basis U) and Cayley "
                           "post-rotation; options: num_axes (d_c), num_planes, learned, relaxed, base"))
register("espr_rf", Entry(EsprRF, features=EsprFeatures,
                          doc="ESPR with positive-random-feature (linear-time) attention; options as espr "
                              "plus num_features, draw_seed"))
register("path", Entry(Path, features=HouseholderVectors,
                       doc="PaTH: keys carried by data-dependent Householder steps I - beta w w^T; options: "
                           "rank, conv, qk_norm, solve_chunk (block_size: the chunk of the blockwise impl)"))
register("fox", Entry(Fox, features=ForgetGate, doc="Forgetting Transformer gate: cumulative log forget "
                                                    "gates added to the logits (a bias for any scheme)"))
register("path_fox", Entry(Path, features=HouseholderVectors, compose=("fox",), doc="PaTH with FoX gates"))
