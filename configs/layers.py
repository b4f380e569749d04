"""Attention per layer: RoPE, NoPE, RoPE in a sliding window, RNoPE-SWA and a Gemma-style local/global
model, same budget, trained at 128 tokens and evaluated to 64x (perplexity) and 16x (retrieval).

    python train.py --config configs/layers.py:rnope_swa
    python sweep.py --config configs/layers.py --seeds=0,1,2,3,4 --out=runs/layers --evals=
    python eval.py --workdirs=<the five arms' runs of a seed> --out=runs/layers/eval/seed<seed> \
        --config.evals=lengths,retrieval "--config.eval_options.lengths.multipliers=(1,4,16,64)" \
        --config.eval_options.lengths.documents=4 --config.eval_options.lengths.within_documents=True \
        --config.eval_options.retrieval.tasks=passkey \
        "--config.eval_options.retrieval.lengths=(128,256,512,1024,2048)" \
        --config.eval_options.retrieval.decode_max_length=256

(docs/results/layers.md: the results and how its tables were made.)

Every training row is a passkey example whose haystack is the row's own text, each answer digit
weighted 20x in the loss (the recipe that teaches a small model to copy, docs/results/
retrieval_mix.md), so one run gives both perplexity on the corpus and retrieval.

Every arm has the same 12 layers of width 64 (4 heads of 16), data order, step budget and seed;
only each layer's scheme, RoPE base and window differ (docs/schemes.md, "Attention per layer"):

  rope         RoPE (base 10K) in every layer, full attention
  nope         no position scheme, full attention
  rope_swa     RoPE in every layer, a sliding window of half the training length (64)
  rnope_swa    RNoPE-SWA (Yang et al. 2025): three RoPE sliding-window layers, then one global
               NoPE layer
  local_global Gemma 2/3: five RoPE sliding-window layers at base 10K, then one global RoPE layer
               at base 1M

12 layers: both patterns repeat whole (3 x 3:1, 2 x 5:1).
"""

from configs import default, parse_arg

WINDOW = 64  # half the training length, as RNoPE-SWA's 4K window at 8K
KINDS = {
    "rope": ("rope", {}, "", {}),
    "nope": ("nope", {}, "", {}),
    "rope_swa": ("rope", {}, "", {}),
    "rnope_swa": ("rope", {"local": {"window": WINDOW}, "global": {"scheme": "nope"}}, "local*3,global", {}),
    "local_global": ("rope", {"local": {"window": WINDOW, "scheme_options": {"base": 1e4}}, "global": {}},
                     "local*5,global", {"base": 1e6}),
}
VARIANTS = tuple(KINDS)
FIELDS = (("arm", "rnope_swa", VARIANTS),)


def get_config(arg: str | None = None):
    arm = parse_arg(__file__, arg, FIELDS)["arm"]
    scheme, kinds, pattern, options = KINDS[arm]
    c = default.get_config(scheme)
    c.model.update(d_model=64, num_layers=12, num_heads=4, layer_kinds=kinds, layer_pattern=pattern,
                   scheme_options=options, window=WINDOW if arm == "rope_swa" else 0)
    c.seq_len, c.batch_size = 128, 16
    c.data.update(retrieval_mix=1.0, retrieval_tasks="passkey", retrieval_answer_weight=20.0)
    c.train.update(steps=800, warmup_steps=50, lr=3e-3, log_every=50, checkpoint_every=200)
    c.eval.update(multipliers=(0.5, 1, 2, 4, 8, 16, 32, 64), tokens=16384, batch_size=8, blockwise_from=1024)
    c.workdir = f"runs/layers/{arm}"
    return c
