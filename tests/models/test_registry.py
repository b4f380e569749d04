"""The registry and what schemes declare on their classes: every declaration agrees with what
the scheme does, and a wrong one is caught."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.default import get_config
from helpers.draws import normal
from models.layers import Attention, ModelConfig
from models.registry import REGISTRY, get_entry, make_scheme, table_row
from positional.alibi import Alibi
from positional.rope import Rope
from positional.scheme import PROBE_FAMILIES, Scheme

H, D, T = 4, 8, 6
# Hooks a bias-only scheme leaves to the base class: it changes the logits by its bias alone.
BASE_HOOKS = ("transform", "transform_out", "score_fn", "transformed_attention", "attend", "weights", "init_cache",
              "decode_step")


def layer_features(name, rng=jax.random.key(1)):
    """(scheme, features) of an attention layer under the named scheme, on random input."""
    cfg = ModelConfig(vocab_size=16, d_model=32, num_heads=H, num_kv_heads=2, scheme=name, head_dim=D)
    layer = Attention(cfg, rngs=nnx.Rngs(0))
    x = normal(jax.random.key(0), (2, T, 32))
    index = jnp.broadcast_to(jnp.arange(T), (2, T))
    return layer.scheme, layer.project(x, index % 16, index, rng=rng)[3]


def mismatches(scheme, features) -> list[str]:
    """The declared flags that disagree with the scheme's hooks on these features."""
    cls, out = type(scheme), []
    if (scheme.bias_fn(features, None) is not None) != scheme.has_bias:
        out.append("has_bias")
    if (scheme.score_fn(features) is not None) != scheme.has_score:
        out.append("has_score")
    pure_bias = scheme.has_bias and all(getattr(cls, h) is getattr(Scheme, h) for h in BASE_HOOKS)
    if scheme.bias_only != pure_bias:
        out.append("bias_only")
    shapes = {name: np.shape(x) for name, x in (features or {}).items()}
    per_token = {"angles": {"psi": (2, T, D // 2), "theta": (2, T, D // 2)},  # layer_features' shapes
                 "householder": {"w": (2, T, 2, D), "beta": (2, T, 2)}}
    for family, needed in per_token.items():
        if (family in scheme.probes) != all(shapes.get(k) == shape for k, shape in needed.items()):
            out.append(f"probes ({family})")
    fixed_pairs = np.shape(getattr(scheme, "theta", None)) == (scheme.head_dim // 2,)
    if ("rope_pairs" in scheme.probes) != fixed_pairs:
        out.append("probes (rope_pairs)")
    return out


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_declared_flags_agree_with_behaviour(name):
    scheme, features = layer_features(name)
    assert not mismatches(scheme, features)
    assert set(scheme.probes) <= set(PROBE_FAMILIES)
    assert scheme.needs_features == bool(features)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_random_features_flag(name):
    """Random features need a key and change with it; the others need none and ignore it."""
    scheme, features = layer_features(name)
    if scheme.random_features:
        with pytest.raises(ValueError, match="rng"):
            layer_features(name, rng=None)
        other = layer_features(name, rng=jax.random.key(2))[1]
        assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(features), jax.tree.leaves(other)))
    else:
        jax.tree.map(np.testing.assert_array_equal, features, layer_features(name, rng=None)[1])


def test_a_wrong_declaration_is_caught():
    @dataclasses.dataclass(frozen=True)
    class SilentAlibi(Alibi):
        has_bias = False

    @dataclasses.dataclass(frozen=True)
    class AddableRope(Rope):
        bias_only = True
        probes = ()

    assert mismatches(SilentAlibi(H, D), None) == ["has_bias", "bias_only"]
    assert mismatches(AddableRope(H, D), None) == ["bias_only", "probes (rope_pairs)"]
    with pytest.raises(TypeError, match="unknown probe families"):
        type("Odd", (Scheme,), {"probes": ("spectra",)})
    with pytest.raises(TypeError, match=r"Reads\.needs_features: define `features\(params, x, \.\.\.\)`") as err:
        type("Reads", (Scheme,), {"needs_features": True})  # features read, none computed
    assert "\n" not in str(err.value)


def test_only_bias_only_schemes_follow_a_plus():
    assert make_scheme("rope+fox", num_heads=H, head_dim=D).biases[0].has_bias
    with pytest.raises(ValueError, match="only score-bias schemes"):
        make_scheme("rope+tapa", num_heads=H, head_dim=D)


def test_config_defaults_come_from_the_scheme_class():
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for name, entry in REGISTRY.items():
        defaults = entry.scheme_cls.config_defaults
        assert set(defaults) <= fields, name
        model = get_config(name).model
        assert all(model[k] == v for k, v in defaults.items()), name
    assert get_config("path_fox").model.block_size == 64
    assert get_config("rope+fox").model.block_size == get_config().model.block_size == 512


def readme_table_rows() -> list[str]:
    """The rows of the scheme table in docs/schemes.md (linked from the README), as written."""
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "schemes.md")) as f:
        section = f.read()
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows, "docs/schemes.md's scheme table has no rows"
    return rows


def test_readme_scheme_table_is_the_registry_rendered():
    for row in readme_table_rows():
        name = row.split("`")[1]
        assert name in REGISTRY, f"docs/schemes.md's scheme table names {name!r}, which is not registered"
        assert row == table_row(name), f"docs/schemes.md row of {name!r} differs from models.registry.table_row"
    missing = set(REGISTRY) - {row.split("`")[1] for row in readme_table_rows()}
    assert not missing, f"registered schemes missing from docs/schemes.md's table: {sorted(missing)} (see table_row)"


def test_a_scheme_defining_the_old_method_name_is_told_the_new_one():
    """`Scheme.attention` (attention on transformed q, k, v) is `transformed_attention`: a scheme
    written against the old name fails where it is defined instead of being silently bypassed."""
    from positional.scheme import Scheme
    with pytest.raises(TypeError, match="defines `attention`, which is called `transformed_attention` now"):
        type("Old", (Scheme,), {"attention": lambda self, *a, **k: None})


def test_no_composition_of_registered_schemes_has_two_features_of_one_name():
    """Feature names are the scheme's own (a composition merges every part's features into one
    dict, and two parts of one name would read each other's): every registered scheme followed by
    every bias-only one builds its features, and the parts' names are disjoint."""
    addable = [n for n, e in REGISTRY.items() if e.scheme_cls.bias_only and not e.compose]
    names = {n: set(layer_features(n)[1] or {}) for n in REGISTRY}
    for first, added in ((f, a) for f in REGISTRY for a in addable):
        parts = [first, *get_entry(first).compose, added]
        if len(set(parts)) < len(parts):  # a part twice: refused, one line
            with pytest.raises(ValueError, match="twice") as raised:
                make_scheme(f"{first}+{added}", num_heads=H, head_dim=D)
            assert "\n" not in str(raised.value)
            continue
        assert not names[first] & names[added], (first, added, names[first] & names[added])  # first: with its composed parts
    layer_features("path_fox+kerple_log+t5")  # three parts merged: no clash raised


# The learned schemes' parameters as runs saved them (names under an attention layer's `features`,
# shapes for d_model 32, vocabulary 16, 4 heads of 8, 2 kv heads), from the models/features.py
# where each scheme had an NNX module of its own (nnx.Linear's kernel and bias): a checkpoint of
# such a run loads into the adapter that holds them now.
PATH_SAVED = {"down/kernel": (32, 32), "up/kernel": (32, 16), "gain/kernel": (32, 2), "gain/bias": (2,),
              "kernel": (3, 16)}
FOX_SAVED = {"proj/kernel": (32, 4), "proj/bias": (4,)}
ESPR_SAVED = {"beta": (4, 1), "basis_skew": (8, 8), "post_skew": (8, 8)}
SAVED = [  # (scheme, options, names and shapes)
    ("so2_learned_qkv", {}, {"table": (16, 4)}), ("so2_hidden_qk", {}, {"proj/kernel": (32, 4)}),
    ("so2_random_qk", {}, {}), ("espr", {}, ESPR_SAVED), ("espr_rf", {}, ESPR_SAVED),
    ("espr", {"relaxed": True}, {**ESPR_SAVED, "drift": (1, 8, 8)}), ("espr", {"learned": False}, {}),
    ("path", {}, PATH_SAVED), ("path", {"conv": 0}, {k: v for k, v in PATH_SAVED.items() if k != "kernel"}),
    ("path_fox", {}, {**{f"parts/0/{k}": v for k, v in PATH_SAVED.items()},
                      **{f"parts/1/{k}": v for k, v in FOX_SAVED.items()}}),
    ("fox", {}, FOX_SAVED), ("rope+fox", {}, FOX_SAVED),
    ("kerple_log", {}, {"kerple_r1": (4,), "kerple_r2": (4,)}), ("t5", {}, {"t5_table": (4, 32)}),
]


@pytest.mark.parametrize("scheme, options, saved", SAVED)
def test_learned_parameters_keep_the_names_runs_saved(scheme, options, saved):
    cfg = ModelConfig(vocab_size=16, d_model=32, num_heads=H, num_kv_heads=2, scheme=scheme, head_dim=D,
                      scheme_options=tuple(options.items()))
    state = nnx.state(Attention(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    got = {"/".join(map(str, path[1:])): x[...].shape for path, x in nnx.to_flat_state(state) if path[0] == "features"}
    assert got == saved
