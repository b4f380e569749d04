"""Sessa against a Transformer and a Mamba2-style mixer in the same block, at CPU scale: the
comparison of the Sessa paper's Table 1 (SymbolSoup, Diffuse MQAR) and Table 2 (language
modelling; the paper's SimpleStories is replaced by the embedded corpus), plus the
no-feedback ablation.

    python train.py --config configs/sessa.py:symbolsoup/sessa         # seed 0
    python train.py --config configs/sessa.py:symbolsoup/sessa/1       # seed 1
    python eval.py --workdirs=runs/sessa/symbolsoup/sessa/seed0,... --out=runs/sessa/symbolsoup

Argument: TASK/MIXER/SEED (FIELDS; default symbolsoup/sessa/0) with TASK in TASKS and MIXER in
MIXERS. The paper matches parameter counts and gives every model the same optimiser, schedule
and number of steps, and reports none of the sizes; here every mixer gets the same depth,
heads, data order, steps and learning rate. The Transformer and Mamba2 get their own width (WIDTHS: the width whose
parameter count is closest to Sessa's at width 64, `models.sessa.matched_width`; 72 and 88
give 77.0K and 74.7K parameters against Sessa's 78.1K on SymbolSoup). The no-feedback ablation
keeps Sessa's width, as in the paper ("feedback branch removed, rest unchanged"). The seed
sets initialisation and data order; the task data sets themselves are fixed (task seed 0, as
the official generator).

CPU scale: a run is STEPS[task] steps of 16 rows, a few minutes on 2 shared cores (300 steps
left Sessa near chance on SymbolSoup). SymbolSoup uses the
official generator with every parameter as published except the length, 100 to 150 tokens
instead of 400 to 600 (the same layout, shorter blocks; `symbolsoup_full` keeps the official
400 to 600); the training set is the official
20,000 examples, of which a run sees 16,000. Diffuse MQAR trains at lags 16 to 32 and is tested
at 8 to 128 (4x the longest training lag). LM: bytes of the default corpus (data.corpus), length 128.
The test sets are smaller than the paper's 2,000 to keep evaluation under a minute.

Parameters as the authors' code (LibratioAI/sessa) builds them: biases on the forward branch's
q/k/v projections (`model.qkv_bias`) and PyTorch's default initialisation of every linear
layer, weights and biases U(+-1/sqrt(fan_in)) (`model.init="torch"`), for every mixer alike.
The choice the results before 2026-11-24 used is `--config.model.qkv_bias=False
--config.model.init=normal` (N(0, 1/fan_in) weights, zero biases, no q/k/v biases). With the
authors' initialisation SymbolSoup stays at chance at this lr (3e-3, chosen with the project's
initialisation) even at 5,000 steps; `--config.train.lr=1e-3` learns it (docs/results/sessa.md,
the SymbolSoup ablation).

Sessa's feedback solve is the blocked one (`model.mixer_options.solve="blocked"`, blocks of 128;
positional/feedback.py): the same values as the dense solve the results before 2026-11-24 used
(`--config.model.mixer_options.solve=reference`) to fp32 rounding, and faster (benchmarks/RESULTS.md,
"Sessa feedback solve: dense vs blocked").
"""

from configs import default, parse_arg
from data import tasks

MIXERS = ("sessa", "transformer", "mamba2", "sessa_nofb")
# d_model per mixer (a Sessa block has ~9 D^2 parameters, a Transformer block ~7 D^2).
WIDTHS = {"sessa": 64, "transformer": 72, "sessa_nofb": 64, "mamba2": 88}
STEPS = {"symbolsoup": 1000, "symbolsoup_full": 1000, "mqar": 500, "lm": 400}
TASKS = {
    "symbolsoup": dict(min_tokens=100, max_tokens=150, eval_examples=400),
    "symbolsoup_full": dict(min_tokens=400, max_tokens=600, eval_examples=400),  # the official lengths
    "mqar": dict(lag_min=16, lag_max=32, eval_lags=(8, 16, 32, 64, 128), eval_examples=500),
    "lm": None,  # byte-level LM on the default corpus (data.corpus)
}


FIELDS = (("task", "symbolsoup", TASKS), ("mixer", "sessa", MIXERS), ("seed", 0, int))


def get_config(arg: str | None = None):
    task, mixer, seed = parse_arg(__file__, arg, FIELDS).values()
    c = default.get_config("rope")  # the forward branch's transport (Sessa's and the Transformer's)
    c.seed = seed
    c.model.update(mixer=mixer, d_model=WIDTHS[mixer], num_layers=2, num_heads=4, qkv_bias=True, init="torch")
    if mixer == "sessa":  # the blocked solve: equal to the dense one to fp32 rounding, faster (docstring)
        c.model.mixer_options.update(solve="blocked", solve_block=128)
    c.batch_size = 16
    c.train.update(steps=STEPS[task], warmup_steps=50, lr=3e-3, log_every=50, checkpoint_every=500)
    if task == "lm":
        c.seq_len = 128
        c.eval.update(multipliers=(1,), tokens=16384, batch_size=8)
    else:
        name = "diffuse_mqar" if task == "mqar" else "symbolsoup"
        c.data.name, c.data.task = name, tasks.default_options(name)
        c.data.task.update(TASKS[task])
        c.seq_len = tasks.get_task(c.data).max_len("train") - 1  # the longest training example
        c.eval.update(batch_size=16, blockwise_from=4096)
    c.workdir = f"runs/sessa/{task}/{mixer}/seed{c.seed}"
    return c
