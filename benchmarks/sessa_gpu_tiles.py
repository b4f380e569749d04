"""Which chunks of Sessa's Pallas feedback solve fit an H100: compiled on this host, no GPU needed.

    python benchmarks/sessa_gpu_tiles.py --tiles 256x256x64x0,256x256x32x0,1024x1024x16x64

Each tile is dk x D x C x Dt: the feedback width, the feature width, the chunk (`block`) and the
feature tile (`block_d`; 0: the kernel's default). The solve's forward + backward (fp32, one row
of --tokens) is compiled for one H100 by XLA's GPU compiler (`lab.lowering.compiled_for`,
topology h100:1: Triton and ptxas as on a GPU). A row says "fits", or the shared memory a kernel
asked for (a block has 227 KiB); and the compile's seconds on this host. JAX's persistent cache
is off. `positional.kernels.feedback_solve.gpu_block` picks the chunk from these figures.
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from lab import cli
from lab.lowering import compiled_for
from positional.kernels.feedback_solve import feedback_solve_pallas

FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_list("tiles", ["256x256x64x0", "256x256x32x0"], "dk x D x C x Dt, several", flag_values=FLAGS)
flags.DEFINE_integer("tokens", 512, "sequence length", flag_values=FLAGS)


def compile_tile(dk: int, d: int, block: int, block_d: int, tokens: int) -> dict:
    """{'fits', 'asked_kib' (None when it fits), 'seconds'} of the solve's gradient for an H100."""
    def loss(qb, kb, gamma, f):
        return feedback_solve_pallas(qb, kb, gamma, f, block=block, block_d=block_d or None).sum()

    shape = jax.ShapeDtypeStruct
    args = (shape((1, tokens, dk), jnp.float32), shape((1, tokens, dk), jnp.float32),
            shape((1, tokens), jnp.float32), shape((1, tokens, d), jnp.float32))
    start = time.perf_counter()
    try:
        compiled_for(jax.grad(loss, (0, 1, 2, 3)), *args, topology="h100:1")
        asked = None
    except jax.errors.JaxRuntimeError as e:
        found = re.search(r"Shared memory size limit exceeded: requested (\d+)", str(e))
        if not found:
            raise
        asked = int(found.group(1)) / 1024
    return {"fits": asked is None, "asked_kib": asked, "seconds": time.perf_counter() - start}


def main(argv):
    del argv  # flags only
    jax.config.update("jax_enable_compilation_cache", False)
    cli.quiet()
    print(f"jax {jax.__version__}, XLA's GPU compiler for one H100 (sm_90a), {FLAGS.tokens} tokens, fp32\n")
    print("| dk | D | C | Dt | fits | shared memory asked | compile s |\n|---:|---:|---:|---:|---|---:|---:|")
    for tile in FLAGS.tiles:
        dk, d, block, block_d = map(int, tile.split("x"))
        r = compile_tile(dk, d, block, block_d, FLAGS.tokens)
        asked = "" if r["fits"] else f"{r['asked_kib']:.1f} KiB"
        print(f"| {dk} | {d} | {block} | {block_d or 'default'} | {'yes' if r['fits'] else 'no'} | {asked} | "
              f"{r['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
