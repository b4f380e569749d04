"""The learned parts of a layer's position scheme, held as NNX parameters (the scheme contract).

A scheme declares its learned parameters (`Scheme.init_parameters`) and the per-token features
its hooks read (`Scheme.features`) as pure functions beside its attention (positional/); the one
adapter here holds the parameters per layer and calls them. It is built as
`SchemeFeatures(scheme, cfg, rngs=rngs)` and called as
`module(x, *, tokens, index, segment_ids, rng)` with x [B, T, d_model]; tokens, index (each
token's index in the sequence: 0..T-1 in the parallel form, the cache slot when decoding) and
segment_ids [B, T]; `rng` a per-layer key (or None); `past` the layer cache when decoding, for
a scheme that `reads_past`. It returns the dict the scheme's hooks read.

Parameters keep the names of the scheme's nested dict (PaTH's `down/kernel`, `gain/bias`, ...),
as attributes of the adapter: the paths of runs saved when each scheme had an NNX module of its
own (nnx.Linear's `kernel` and `bias`).
"""

from __future__ import annotations

from flax import nnx


def _held(tree):
    return nnx.Dict({k: _held(v) for k, v in tree.items()}) if isinstance(tree, dict) else nnx.Param(tree)


def _read(held):
    return {k: _read(v) for k, v in held.items()} if isinstance(held, nnx.Dict) else held[...]


class SchemeFeatures(nnx.Module):
    """One scheme's learned parameters (`init_parameters`, drawn from the model's `rngs.params`)
    and its features of the layer input (`features`)."""

    def __init__(self, scheme, cfg, *, rngs: nnx.Rngs):
        self.scheme = scheme
        self.reads_past = scheme.reads_past
        init = scheme.init_parameters(rngs.params, cfg)
        self.names = tuple(init)
        for name, x in init.items():
            setattr(self, name, _held(x))

    def __call__(self, x, **kw):
        return self.scheme.features({name: _read(getattr(self, name)) for name in self.names}, x, **kw)


class MergedFeatures(nnx.Module):
    """The features of a composed scheme ("path+fox"): each part's, one merged dict."""

    def __init__(self, modules):
        self.parts = nnx.List(modules)
        self.reads_past = any(m.reads_past for m in modules)

    def __call__(self, x, past=None, **kw):
        out = {}
        for m in self.parts:
            got = m(x, **kw, **({"past": past} if m.reads_past else {}))
            clash = set(out) & set(got)
            if clash:
                raise ValueError(f"composed schemes both produce feature(s) {sorted(clash)}")
            out.update(got)
        return out
