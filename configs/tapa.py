"""TAPA against RoPE and its extensions (PI, YaRN, base change), pretrain-then-extend, at small
scale: the comparison of the TAPA paper's Tables 1-3 and Figure 1.

The paper pretrains at 8K, extends at 32K (4x) with the same hyper-parameters for every method,
and evaluates from 1K to 64K (L/8 to 8L) with sliding windows. Here L = 128 bytes:

    # 1. pretrain (rope, tapa, and the linear-phase ablation tapa_linear)
    python train.py --config configs/tapa.py:pretrain/rope
    # 2. extend at 4L = 512 from the pretrained checkpoint; METHOD in EXTEND below
    python train.py --config configs/tapa.py:extend/yarn
    # 3. zero-shot: the pretrained parameters under the extension's scheme, no training
    python train.py --config configs/tapa.py:zeroshot/yarn
    python eval.py --workdirs=runs/tapa/extend/rope,runs/tapa/extend/tapa,... --out=runs/tapa/extended

Pretraining: 600 steps x 16 rows x 128 tokens for every scheme (same seed, data order and
learning rate; the paper lowered TAPA's pretraining LR 5x, a confound we do not copy).
Extension: 150 steps x 4 rows x 512 tokens (the same tokens per step), learning rate 1e-3 for
every method. With LRS "paper" (`configs/tapa.py:pretrain/tapa/paper`, `extend/yarn/paper`, ...)
the paper's learning-rate ratios instead: TAPA pretrains at 6e-4 (RoPE's / 5) and every method
extends at 6e-4. The evaluation lengths are 16 ... 1024 tokens and 768 (1.5x the extension length, the
paper's 49,152 = 1.5 x 32K); windows slide by `eval.stride`.
"""

from configs import default, parse_arg

PRETRAIN_LEN, FACTOR = 128, 4
PRETRAIN = ("rope", "tapa", "tapa_linear")
# Extension methods: (pretrained scheme, scheme options switched on at the extension). PI and
# YaRN use the paper's factor 8 (= the longest evaluation length over the pretraining length).
EXTEND = {
    "rope": ("rope", {}),
    "rope_base": ("rope", {"base": 1e6}),  # base change, 100x (the paper: 5e5 -> 2e8)
    "pi": ("rope", {"scaling": "pi", "factor": 8.0, "original_max_len": PRETRAIN_LEN}),
    "yarn": ("rope", {"scaling": "yarn", "factor": 8.0, "original_max_len": PRETRAIN_LEN}),
    "tapa": ("tapa", {}),
    "tapa_linear": ("tapa_linear", {}),
}
EVAL_LENGTHS = (16, 32, 64, 128, 256, 512, 768, 1024)  # L/8 ... 8L, and 1.5x the extension length
# STAGE/METHOD: a pretrained scheme after pretrain, an extension method after extend or zeroshot.
# LRS: "same", every pretraining at 3e-3 and every extension at 1e-3 (tapa.md's earlier tables);
# "paper", the paper's ratios: TAPA pretrains at RoPE's rate / 5 and every method extends at
# that rate (the paper: 1e-4 and 2e-5, extension at 2e-5).
LR, SLOW_LR = 3e-3, 6e-4  # RoPE's pretraining rate, and it / 5
FIELDS = (("stage", "pretrain", ("pretrain", "extend", "zeroshot")),
          ("method", "tapa", lambda fields: PRETRAIN if fields["stage"] == "pretrain" else tuple(EXTEND)),
          ("lrs", "same", ("same", "paper")))


def get_config(arg: str | None = None):
    stage, method, lrs = parse_arg(__file__, arg, FIELDS).values()
    suffix = "_paper" if lrs == "paper" else ""  # of the runs' folders
    if stage == "pretrain":
        scheme, options, seq_len = method, {}, PRETRAIN_LEN
    else:
        scheme, options = EXTEND[method]
        seq_len = PRETRAIN_LEN * FACTOR if stage == "extend" else PRETRAIN_LEN
    c = default.get_config(scheme)
    c.model.update(d_model=128, num_layers=3, num_heads=4)
    c.model.scheme_options.update(options)
    c.seq_len = seq_len
    c.batch_size = 16 * PRETRAIN_LEN // seq_len
    c.train.update(steps=600, warmup_steps=50, log_every=50, checkpoint_every=200,
                   lr=SLOW_LR if lrs == "paper" and scheme.startswith("tapa") else LR)
    if stage != "pretrain":
        c.init_from = f"runs/tapa/pretrain/{scheme}{suffix}"
        c.train.update(steps=150 if stage == "extend" else 0, warmup_steps=15, lr=SLOW_LR if lrs == "paper" else 1e-3,
                       log_every=25, checkpoint_every=150)
    c.eval.update(multipliers=tuple(n / seq_len for n in EVAL_LENGTHS), tokens=8192, stride=64,
                  batch_size=8, blockwise_from=1024)
    c.workdir = f"runs/tapa/{stage}/{method}{suffix}"
    return c
