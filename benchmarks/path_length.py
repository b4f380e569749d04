"""Forward time per token against length: chunked PaTH against blockwise RoPE, in one process.

    python benchmarks/path_length.py --lengths 1024,2048,4096,8192

The default model (configs/default.py, byte vocab 258) scores one row with `token_nll`, as the
eval loop does: RoPE with blockwise attention (512-token blocks), PaTH with its chunked
algorithm (64-token chunks, configs/default.py). Both are compiled first; then the calls
alternate, `--repeats` times each, and the fastest is kept, so load from other jobs on a
shared machine falls on both. Attention is O(T^2), so time per token grows linearly for both;
the ratio column says whether PaTH's grows faster than attention's.
"""

from __future__ import annotations

import sys
import time


import jax  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

from configs.default import get_config  # noqa: E402
from models.lm import DecoderLM, ModelConfig, token_nll  # noqa: E402

# Process-wide only when run as a script (why: benchmarks/train_throughput.py).
FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_string("lengths", "1024,2048,4096,8192", "sequence lengths, comma-separated", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 2, "timed calls; the best is kept", flag_values=FLAGS)

VOCAB = 258
SCHEMES = ("rope", "path")


def compiled_forward(scheme: str, length: int):
    model_dict = {**get_config(scheme).model.to_dict(), "vocab_size": VOCAB}
    if scheme == "rope":
        model_dict["attention_impl"] = "blockwise"
    model = DecoderLM(ModelConfig.from_dict(model_dict), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (1, length + 1), 0, VOCAB)
    fn = jax.jit(lambda state, tokens: token_nll(nnx.merge(graphdef, state), tokens)[0])
    return fn.lower(state, tokens).compile(), state, tokens


def benchmark() -> dict:
    """{length: {scheme: best seconds}}, as FLAGS ask."""
    lengths = [int(x) for x in FLAGS.lengths.split(",")]
    seconds = {}
    for length in lengths:
        calls = {s: compiled_forward(s, length) for s in SCHEMES}
        best = {s: float("inf") for s in SCHEMES}
        for _ in range(FLAGS.repeats):
            for s, (fn, state, tokens) in calls.items():
                t0 = time.perf_counter()
                fn(state, tokens).block_until_ready()
                best[s] = min(best[s], time.perf_counter() - t0)
        seconds[length] = best
        print(f"# {length}: {best}", file=sys.stderr, flush=True)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, best of {FLAGS.repeats}\n")
    print("| length | rope s | path s | rope us/token | path us/token | path / rope |")
    print("|---:|---:|---:|---:|---:|---:|")
    for length, best in seconds.items():
        r, pth = best["rope"], best["path"]
        print(f"| {length:,} | {r:.2f} | {pth:.2f} | {1e6 * r / length:.0f} | {1e6 * pth / length:.0f} | "
              f"{pth / r:.2f} |")
    return seconds


def main(argv):
    del argv  # flags only
    benchmark()


if __name__ == "__main__":
    app.run(main)
