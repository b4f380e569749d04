"""Accumulated transformations (SO(2) transport) against RoPE, RoPE-QKV and ALiBi, at small scale:
the comparison of the paper's Tables 1 and 2, plus SO(2) with an ALiBi bias.

    python train.py --config configs/accumulated.py:so2_learned_qkv
    python eval.py --workdirs=runs/accumulated/rope,runs/accumulated/so2_learned_qkv \
        --out=runs/accumulated/compare --max_multiplier=64

Every variant has the same model, data order, step budget and seed. Training length 128, so
that 64x (8,192 tokens) is cheap to evaluate on a CPU.
"""

from configs import SCHEME, default, parse_arg

VARIANTS = ("rope", "rope_qkv", "so2_random_qk", "so2_random_qkv", "so2_learned_qk",
            "so2_learned_qkv", "alibi", "so2_learned_qkv+alibi")


FIELDS = (("scheme", "so2_learned_qkv", SCHEME),)


def get_config(arg: str | None = None):
    scheme = parse_arg(__file__, arg, FIELDS)["scheme"]
    c = default.get_config(scheme)
    c.model.update(d_model=128, num_layers=3, num_heads=4)
    c.seq_len, c.batch_size = 128, 16
    c.train.update(steps=600, warmup_steps=50, lr=3e-3, log_every=50, checkpoint_every=200)
    c.eval.update(multipliers=(0.5, 1, 2, 4, 8, 16, 32, 64), tokens=16384, batch_size=8,
                  blockwise_from=1024)
    c.workdir = f"runs/accumulated/{scheme}"
    return c
