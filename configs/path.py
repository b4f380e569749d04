"""PaTH (accumulated Householder transport) and FoX forget gates against RoPE and the best SO(2)
transport, at small scale: the comparison the accumulated-transformations paper draws between
its rotations and PaTH / PaTH-FoX.

    python train.py --config configs/path.py:path
    python eval.py --workdirs=runs/accumulated/rope,runs/accumulated/so2_learned_qkv,runs/path/path,\
runs/path/path_fox,runs/path/fox --out=runs/path/compare --max_multiplier=64

Model, data order, step budget and seed are those of configs/accumulated.py, so its rope and
so2_learned_qkv runs are the same runs (`configs/path.py:rope` retrains them under runs/path/).
The runs reported in docs/results/path.md trained with the flash-style chunked algorithm
(impl "blockwise", 64-token chunks); configs now train PaTH with the materialised logits (impl
"reference", one UT solve per 64 tokens), the same function computed faster at these lengths
(benchmarks/RESULTS.md, section 'PaTH and FoX training-step throughput').
"""

from configs import SCHEME, accumulated, parse_arg

VARIANTS = ("rope", "so2_learned_qkv", "path", "path_fox", "fox")


FIELDS = (("scheme", "path", SCHEME),)


def get_config(arg: str | None = None):
    scheme = parse_arg(__file__, arg, FIELDS)["scheme"]
    c = accumulated.get_config(scheme)
    c.workdir = f"runs/path/{scheme}"
    return c
