"""Compile the Pallas-Triton kernels for an NVIDIA GPU on this host, no GPU needed: each scheme's
fused attention (forward + backward, impl="pallas", bf16, segment ids) is lowered for cuda
(`lab.lowering`), its Triton modules are taken from the exported module
(`lab.lowering.triton_kernels`) and compiled by the `triton` package (its compiler and the ptxas
it ships) for a compute capability (default 90: H100, H200). Per kernel: lines of Triton IR,
its reductions (tt.reduce), compile seconds, shared memory, registers and spilled bytes
(ptxas -v). A kernel that spills, or asks for more shared memory than the chip has, shows here
before a GPU session.

    pip install triton==3.6.0        # the GPU machine's release; not a project dependency
    python benchmarks/triton_compile.py --schemes kerple_log,t5 --tokens 1000

XLA compiles the same IR with the Triton that jaxlib bundles, whose passes may differ from the
package's: compile seconds here are indicative only (benchmarks/RESULTS.md: an H200 took 232 s
over T5's kernels; this script's figures for them are beside it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from lab.lowering import exported_text, max_registers, triton_kernels
from models.registry import make_scheme
from positional.attention import attention

FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_list("schemes", ["plain", "kerple_log", "t5"], "registered schemes ('plain': no bias), each "
                  "with its options after slashes (block_size: attend's), e.g. "
                  "path_fox/span=512/across=blocks/block_size=64", flag_values=FLAGS)
flags.DEFINE_integer("tokens", 1000, "sequence length", flag_values=FLAGS)
flags.DEFINE_integer("heads", 4, "query heads", flag_values=FLAGS)
flags.DEFINE_integer("kv_heads", 2, "key / value heads", flag_values=FLAGS)
flags.DEFINE_integer("head_dim", 64, "head dimension", flag_values=FLAGS)
flags.DEFINE_integer("capability", 90, "the GPU's compute capability, major * 10 + minor", flag_values=FLAGS)
flags.DEFINE_integer("maxnreg", None, "registers per thread a kernel may use, set on each lowered module "
                     "(lab.lowering.max_registers: Triton's ttg.maxnreg, PTX's .maxnreg); default none, as "
                     "Pallas-Triton leaves it", flag_values=FLAGS)


def kernels(spec: str, t: int, h: int, kh: int, d: int) -> list[dict]:
    """The Triton kernels of one fused attention call's forward + backward, lowered for cuda;
    spec: a scheme's name and its options, "name/option=value/..."."""
    name, *options = spec.split("/")
    options = {k: int(v) if v.isdigit() else v for k, v in (x.split("=", 1) for x in options)}
    block_size = options.pop("block_size", 512)  # attend's (PaTH's chunk); the rest are the scheme's
    q = jax.ShapeDtypeStruct((1, t, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, t, kh, d), jnp.bfloat16)
    seg, positions = jnp.ones((1, t), jnp.int32), jnp.arange(t)[None]
    scheme = None if name == "plain" else make_scheme(name, num_heads=h, head_dim=d, **options)

    def loss(q, k, v):
        if scheme is None:
            out = attention(q, k, v, impl="pallas", segment_ids=seg)
        else:
            out = scheme.attend(q, k, v, positions=positions, segment_ids=seg, impl="pallas", key=jax.random.key(0),
                                block_size=block_size)
        return out.astype(jnp.float32).sum()

    return triton_kernels(exported_text(jax.grad(loss, (0, 1, 2)), q, kv, kv, platform="cuda"))


def compiled(kernel: dict, capability: int) -> dict:
    """Compile one kernel with the triton package; ptxas -v reads its registers and spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRITON_CACHE_DIR"] = tmp  # a fresh compile, not a cached one
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(kernel["ttir"])
        start = time.perf_counter()
        out = triton.compile(path, target=GPUTarget("cuda", capability, 32),
                             options={"num_warps": kernel["num_warps"], "num_stages": kernel["num_stages"]})
        seconds = time.perf_counter() - start
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(out.asm["ptx"])
        arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
        report = subprocess.run([get_ptxas(capability).path, "-v", "--gpu-name", arch, ptx, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    number = lambda word: int(report.split(word)[0].split()[-1]) if word in report else 0  # noqa: E731
    return {"seconds": seconds, "shared_kib": out.metadata.shared / 1024, "registers": number(" registers"),
            "spill_bytes": number(" bytes spill stores")}


def table(rows: list[dict]) -> str:
    lines = ["| scheme | kernel | warps / stages | IR lines | reductions | compile s | shared KiB | registers | "
             "spilled bytes |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['kernel']} | {r['num_warps']} / {r['num_stages']} | {r['lines']} | "
                     f"{r['reductions']} | {r['seconds']:.1f} | {r['shared_kib']:.1f} | {r['registers']} | "
                     f"{r['spill_bytes']} |")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}; flags only")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("error: this needs the triton package (not a project dependency): pip install triton==3.6.0, "
                 "the release the GPU machine has")
    rows = []
    for name in FLAGS.schemes:
        with max_registers(FLAGS.maxnreg):
            found = kernels(name, FLAGS.tokens, FLAGS.heads, FLAGS.kv_heads, FLAGS.head_dim)
        for i, kernel in enumerate(found):
            rows.append({"scheme": name, "kernel": f"{i + 1} of {len(found)}", "num_warps": kernel["num_warps"],
                         "num_stages": kernel["num_stages"], "lines": len(kernel["ttir"].splitlines()),
                         "reductions": len(re.findall(r"\btt\.reduce\b(?!\.)", kernel["ttir"])),
                         **compiled(kernel, FLAGS.capability)})
            print(rows[-1], flush=True)
    print(f"\njax {jax.__version__}, triton {__import__('triton').__version__}, sm_{FLAGS.capability}, "
          f"{FLAGS.tokens} tokens, {FLAGS.heads} heads on {FLAGS.kv_heads}, head dim {FLAGS.head_dim}, bf16"
          + (f", maxnreg {FLAGS.maxnreg}" if FLAGS.maxnreg else "") + "\n")
    print(table(rows))


if __name__ == "__main__":
    app.run(main)
