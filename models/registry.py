"""The scheme registry: the one place every part of the codebase looks a scheme up by name.

An entry names the pure `Scheme` class from `positional/` and the options it fixes. A scheme's
learned parts are its own (`Scheme.init_parameters` and `Scheme.features`); a layer holds them in
models/features.py's one adapter.

A name may add score-bias schemes to a scheme with "+": "so2_learned_qkv+alibi" is the SO(2)
transport with ALiBi's bias on its logits. User options apply to the first scheme.

Adding a scheme: one file in `positional/` and one `register(...)` line here. The conformance
suite in `tests/` then covers it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models.features import MergedFeatures, SchemeFeatures
from positional.alibi import Alibi
from positional.espr import Espr, EsprRF
from positional.fox import Fox
from positional.path.scheme import Path
from positional.kerple import KerpleLog
from positional.lm_infinite import LMInfinite
from positional.nope import NoPE, TemperedNoPE
from positional.prope import PRope
from positional.rope import Rope
from positional.scheme import Scheme
from positional.so2 import SO2
from positional.t5 import T5Bias
from positional.tapa import Tapa


@dataclasses.dataclass(frozen=True)
class Entry:
    scheme_cls: type[Scheme]
    fixed: dict[str, Any] = dataclasses.field(default_factory=dict)
    doc: str = ""
    compose: tuple = ()  # score-bias schemes always added, as if written "name+bias"
    compose_fixed: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # their fixed options
    # Whether the scheme's default features (none given) are its features at initialisation on a
    # zero input (the conformance suite checks the values of every scheme that says so, the
    # names, shapes and dtypes of every one);
    # False where the defaults are drawn from the call's key instead (PaTH's directions, KERPLE's r1 and
    # r2, each drawn as its parameters are).
    features_at_init: bool = True


REGISTRY: dict[str, Entry] = {}
# The Scheme fields the layer sets, not the scheme's options.
LAYER_FIELDS = ("num_heads", "head_dim", "biases", "sliding_window", "attention_chunk")


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


def _fixed(entry: Entry) -> set:
    """The options an entry fixes, its own and those of the parts it composes."""
    return {*entry.fixed, *(o for opts in entry.compose_fixed.values() for o in opts)}


_TYPE_WORDS = {"float": "a number", "int": "an integer", "bool": "True or False", "str": "a string"}


def _of_type(value, annotation: str) -> bool:
    """Whether an option's value fits its field's annotation (the plain ones options use)."""
    if annotation == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation == "bool":
        return isinstance(value, bool)
    if annotation == "str":
        return isinstance(value, str)
    return True


def _options(entry: Entry) -> set:
    return {f.name for f in dataclasses.fields(entry.scheme_cls)} - set(LAYER_FIELDS)


def table_row(name: str) -> str:
    """The row of a registered name in the scheme table of docs/schemes.md: | `name` | doc |
    options |, the options being the scheme's dataclass fields less the fixed ones (and those of
    the parts it composes), in declaration order."""
    entry = get_entry(name)
    options = [f.name for e in parts(name) for f in dataclasses.fields(e.scheme_cls)
               if f.name not in (*LAYER_FIELDS, *_fixed(entry))]
    cells = (f"`{name}`", entry.doc.replace("|", "\\|"), ", ".join(f"`{o}`" for o in options) or "—")
    return f"| {' | '.join(cells)} |"


def make_scheme(name: str, *, num_heads: int, head_dim: int, sliding_window: int = 0, attention_chunk: int = 0,
                **options) -> Scheme:
    """Build the named scheme with user options (e.g. RoPE's base, scaling, factor). An option
    that the first part lacks goes to the added score-bias parts that have it ("path_fox" with
    gate_bias sets FoX's). `sliding_window` > 0: its attention within a sliding window of that
    many tokens; `attention_chunk` > 0: within chunks of that many (positional/scheme.py); the
    layer's choices, not options."""
    first, *added = name.split("+")
    entry = get_entry(first)
    added = [*entry.compose, *added]
    twice = sorted({p for p in added if [first, *added].count(p) > 1})
    if twice:
        raise ValueError(f"{name!r} has {', '.join(map(repr, twice))} twice (counting the parts {first!r} composes: "
                         f"{', '.join(entry.compose) or 'none'}); each part may appear once")
    fields = _options(entry)
    part_fields = {part: _options(get_entry(part)) for part in added}
    unknown = set(options) - fields - set().union(*part_fields.values())
    if unknown:
        valid = [o for o in sorted(fields) + [o for p in added for o in sorted(part_fields[p])]
                 if o not in _fixed(entry)]
        raise ValueError(f"scheme {name!r} has no option(s) {sorted(unknown)}; "
                         f"its options are: {valid or 'none'}")
    fixed = set(options) & _fixed(entry)
    if fixed:
        raise ValueError(f"scheme {first!r} fixes option(s) {sorted(fixed)}; choose another scheme")
    for field in dataclasses.fields(entry.scheme_cls):
        if field.name in options and not _of_type(options[field.name], field.type):
            raise ValueError(f"scheme {first!r} option {field.name}={options[field.name]!r} must be "
                             f"{_TYPE_WORDS.get(field.type, field.type)}; set it as "
                             f"model.scheme_options.{field.name}=<{field.type}>")
    biases = []
    for part in added:
        part_entry = get_entry(part)
        if not _addable(part_entry):
            raise ValueError(f"{name!r}: only score-bias schemes can be added with '+', and {part!r} "
                             f"is not one; bias-only schemes: "
                             f"{', '.join(n for n, e in sorted(REGISTRY.items()) if _addable(e))}")
        mine = {k: v for k, v in options.items() if k not in fields and k in part_fields[part]}
        mine.update(entry.compose_fixed.get(part, {}))
        biases.append(make_scheme(part, num_heads=num_heads, head_dim=head_dim, **mine))
    return entry.scheme_cls(num_heads=num_heads, head_dim=head_dim, biases=tuple(biases), sliding_window=sliding_window,
                            attention_chunk=attention_chunk, **entry.fixed, **{k: v for k, v in options.items() if k in fields})


def make_features(scheme: Scheme, cfg, *, rngs):
    """The learned features of a layer: the scheme's and each added bias's, one dict out (None
    where no part reads features)."""
    modules = [SchemeFeatures(s, cfg, rngs=rngs) for s in (scheme, *scheme.biases) if s.needs_features]
    if len(modules) <= 1:
        return modules[0] if modules else None
    return MergedFeatures(modules)


STEP_DOCS = {"random": "steps ~ U(-f_b, f_b) drawn afresh every forward pass (`draw_seed` >= 0 fixes the draw)",
             "learned": "steps omega + g[token] (a learned vocab x blocks table per layer)",
             "hidden": "steps omega + W h, a projection of the layer input (not in the paper)"}

register("nope", Entry(NoPE, doc="no position information"))
register("nope_temperature", Entry(TemperedNoPE, doc="NoPE with Llama 4's query temperature 1 + `attn_scale` log(1 + "
                                                     "floor((p + 1) / `floor_scale`)) at the query's position p"))
register("alibi", Entry(Alibi, doc="linear distance bias, slopes 2^(-8h/H)"))
register("rope", Entry(Rope, doc="rotary q/k; `layout` `half` or `interleaved`, `scaling` `none`, `pi`, `ntk`, "
                                 "`yarn`, `llama3`, `dynamic` or `longrope`"))
register("rope_qkv", Entry(Rope, fixed={"rotate_values": True}, doc="rotary q/k/v, head output rotated back"))
for _steps in ("random", "learned", "hidden"):
    for _qkv in (False, True):
        register(f"so2_{_steps}_{'qkv' if _qkv else 'qk'}",
                 Entry(SO2, fixed={"steps": _steps, "rotate_values": _qkv},
                       doc=f"accumulated SO(2) transport of {'q/k/v' if _qkv else 'q/k'}, {STEP_DOCS[_steps]}"))
register("tapa", Entry(Tapa, doc="token-aware phase attention: (q_A.k_A) cos(2 pi |i-j|^alpha q_P.k_P), no "
                                 "rotation"))
register("tapa_linear", Entry(Tapa, fixed={"phase": "linear"}, doc="TAPA with the paper's linear-phase ablation"))
register("espr", Entry(Espr,
                       doc="ESPR / STRING: learned commuting generators (shared orthogonal basis, per-plane "
                           "frequencies) over 1-, 2- or 3-axis positions (`positions` [B, T, d_c]), Cayley "
                           "post-rotation"))
register("espr_rf", Entry(EsprRF,
                          doc="`espr` with positive-random-feature (linear-time) attention"))
register("path", Entry(Path, features_at_init=False,
                       doc="PaTH: each key carried forward by the Householder steps I - beta_t w_t w_t^T of the "
                           "tokens after it (w from a rank-`rank` projection + short causal convolution, beta = "
                           "2 sigmoid in (0, 2)); impl `reference` materialises the logits with one UT solve per "
                           "`solve_chunk` tokens, `blockwise` is the flash-style chunked algorithm with O(T x D) "
                           "memory (`block_size` = chunk; in two levels with blocks of `span` tokens where span > 0, "
                           "`outer_group` blocks a step across them; `tiles` = bf16: "
                           "its q.k and P.V on bf16 operands), `pallas` the fused kernel (with `span`: inside the blocks, "
                           "each its own sequence; across them the chunked form, or with `across` = blocks the "
                           "across-blocks kernel, positional/path/across.py; `across` = chunks: that kernel between "
                           "chunks too, no PaTH kernel) (positional/path/kernel.py; what `auto` "
                           "picks on TPU; on GPU it picks `blockwise`, measured faster)"))
register("fox", Entry(Fox,
                      doc="Forgetting Transformer gate: sum of log forget gates between key and query added to "
                          "the logits; a bias like ALiBi, so `scheme+fox` works for any scheme"))
register("path_fox", Entry(Path, compose=("fox",), features_at_init=False,
                           compose_fixed={"fox": {"logit_scale": True}},
                           doc="`path` with FoX gates on the PaTH authors' scale: (q^T P k + F_i - F_j) / sqrt(D) "
                               "(`path+fox`: FoX's, q^T P k / sqrt(D) + F_i - F_j)"))
register("kerple_log", Entry(KerpleLog, features_at_init=False,
                             doc="KERPLE-log: learned bias -r1 log(1 + r2 distance), r1, r2 > 0 per head"))
register("t5", Entry(T5Bias, doc="T5's relative bias: a learned per-head table (from 0) read at the distance's bucket, "
                                 "one per distance below `num_buckets` / 2, then log-spaced to `max_distance`"))
register("p_rope", Entry(PRope, doc="p-RoPE: RoPE whose lowest-frequency pairs do not rotate (the highest "
                                   "`fraction` p of frequencies kept; 1 is RoPE, 0 NoPE)"))
register("rope_lm_infinite", Entry(LMInfinite, fixed={"rotate_values": False},
                                   doc="LM-Infinite: RoPE read at distance min(i-j, `window`) under a Lambda mask (the "
                                       "document's first `global_tokens` keys and the last `window`); for a RoPE run "
                                       "zero-shot, `window` defaulting to its training length"))
