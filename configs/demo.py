"""The demo: small byte-level LMs on the default corpus (data.corpus: pinned Python sources), trained
at length 256 and evaluated from 128 to 4,096 tokens (16x).

    python train.py --config configs/demo.py:alibi          # one scheme
    python train.py --config configs/demo.py:rope/fast      # the ~2-minute smoke version
    make demo                                               # all demo schemes + comparison

Every scheme gets the same model, data order, seed and step budget.
"""

from configs import SCHEME, default, parse_arg

FIELDS = (("scheme", "rope", SCHEME), ("size", "full", ("full", "fast")))


def get_config(arg: str | None = None):
    scheme, size = parse_arg(__file__, arg, FIELDS).values()
    c = default.get_config(scheme)
    c.model.update(d_model=128, num_layers=3, num_heads=4)
    c.seq_len, c.batch_size = 256, 16
    c.train.update(steps=400, warmup_steps=50, lr=3e-3, log_every=25, checkpoint_every=200)
    c.eval.update(multipliers=(0.5, 1, 2, 4, 8, 16), tokens=16384, batch_size=4)
    c.workdir = f"runs/demo/{scheme}"
    if size == "fast":
        c.model.update(d_model=64, num_layers=2)
        c.seq_len, c.batch_size = 128, 8
        c.train.update(steps=60, warmup_steps=10, log_every=20, checkpoint_every=60)
        c.eval.update(tokens=2048)
        c.workdir = f"runs/demo-fast/{scheme}"
    return c
