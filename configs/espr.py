"""ESPR / STRING rotations against RoPE on the embedded corpus (text, d_c = 1), at small scale.

    python train.py --config configs/espr.py:espr
    python eval.py --workdirs=runs/accumulated/rope,runs/espr/espr --out=runs/espr/compare \
        --max_multiplier=64

Every variant has the same model, data order, step budget, seed and evaluation as
configs/accumulated.py (tests/project/test_configs.py checks it), so its `rope` run serves as the
baseline here too; sized to a few minutes on a 2-core CPU. The 2-D grid comparison (1-D
RoPE over the flattened order, axial 2-D RoPE, STRING and relaxed ESPR with d_c = 2, under
position shifts) is `python benchmarks/grid2d.py` (see docs/results/espr.md).
"""

from configs import SCHEME, accumulated, parse_arg

VARIANTS = ("rope", "espr", "espr_rf")


FIELDS = (("scheme", "espr", SCHEME),)


def get_config(arg: str | None = None):
    scheme = parse_arg(__file__, arg, FIELDS)["scheme"]
    c = accumulated.get_config(scheme)
    if scheme.startswith("espr_rf"):
        c.model.scheme_options = {"draw_seed": 0}  # a fixed draw: evaluation sees the training features
    c.workdir = f"runs/espr/{scheme}"
    return c
