"""Compile the Pallas-Triton kernels for an NVIDIA GPU on this host, no GPU needed: each scheme's
fused attention (forward + backward, impl="pallas", bf16, segment ids) is compiled for one H100
by XLA's GPU compiler, as on a GPU (`lab.lowering.compiled_for`, topology `h100:1`: jax's
CUDA plugin, its Triton and ptxas for sm_90a). Per kernel, in the exported module's order:
lines of Triton IR, its reductions (tt.reduce), shared memory (XLA's launch plan), registers
and spilled bytes (ptxas -v, as XLA runs it), and each scheme's whole compile in seconds. A
kernel that spills, or asks for more shared memory than the chip has, shows here before a GPU
session; a limit on registers (--maxnreg) shows whether XLA's compile keeps it.

    python benchmarks/triton_compile.py --schemes kerple_log,t5 --tokens 1000

The compile runs with XLA's logging of ptxas on (TF_CPP_VMODULE, XLA_FLAGS set at the start,
before the CUDA plugin loads) and writes XLA's dump to a temporary folder; JAX's persistent
compilation cache is off (every kernel is compiled anew). Compile seconds are this host's.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from lab import cli
from lab.lowering import compiled_for, exported_text, max_registers, triton_kernels
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
flags.DEFINE_integer("maxnreg", None, "registers per thread a kernel may use, set on each lowered module "
                     "(lab.lowering.max_registers: Triton's ttg.maxnreg, PTX's .maxnreg); default none, as "
                     "Pallas-Triton leaves it", flag_values=FLAGS)


def attention_grad(spec: str, t: int, h: int, kh: int, d: int):
    """(grad of one fused attention call's sum over q, k, v; its abstract q, k, v); spec: a
    scheme's name and its options, "name/option=value/..." (block_size: attend's, PaTH's chunk)."""
    name, *options = spec.split("/")
    options = {k: int(v) if v.isdigit() else v for k, v in (x.split("=", 1) for x in options)}
    block_size = options.pop("block_size", 512)  # attend's (PaTH's chunk); the rest are the scheme's
    q = jax.ShapeDtypeStruct((1, t, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, t, kh, d), jnp.bfloat16)
    scheme = None if name == "plain" else make_scheme(name, num_heads=h, head_dim=d, **options)

    def loss(q, k, v):
        seg, positions = jnp.ones((1, t), jnp.int32), jnp.arange(t)[None]
        if scheme is None:
            out = attention(q, k, v, impl="pallas", segment_ids=seg)
        else:
            out = scheme.attend(q, k, v, positions=positions, segment_ids=seg, impl="pallas", key=jax.random.key(0),
                                block_size=block_size)
        return out.astype(jnp.float32).sum()

    return jax.grad(loss, (0, 1, 2)), (q, kv, kv)


def kernels(spec: str, t: int, h: int, kh: int, d: int) -> list[dict]:
    """The Triton kernels of one fused attention call's forward + backward, lowered for cuda
    (`lab.lowering.triton_kernels`: name, num_warps, num_stages, Triton IR)."""
    fn, args = attention_grad(spec, t, h, kh, d)
    return triton_kernels(exported_text(fn, *args, platform="cuda"))


@contextlib.contextmanager
def stderr_to(path: str):
    """File descriptor 2 (where XLA's C++ logs go) into `path` while the block runs."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def ptxas_reports(log: str) -> dict[str, list[dict]]:
    """ptxas -v's report of each entry function in XLA's log: name -> [{registers, spill_bytes}]
    (a name XLA compiled more than once has several)."""
    found: dict[str, list[dict]] = {}
    for name, body in re.findall(r"Compiling entry function '(\w+)'(.*?)(?=Compiling entry function|\Z)", log, re.S):
        number = lambda pattern: int(m[1]) if (m := re.search(pattern, body)) else 0  # noqa: E731
        found.setdefault(name, []).append({"registers": number(r"Used (\d+) registers"),
                                           "spill_bytes": number(r"(\d+) bytes spill stores")})
    return found


def shared_memory(dump: str) -> dict[str, int]:
    """Bytes of shared memory XLA launches each kernel with, from the newest thunk sequence in
    its dump folder (kernel name -> bytes)."""
    newest = max(glob.glob(os.path.join(dump, "*thunk_sequence.txt")), key=os.path.getmtime)
    return {name: int(size) for name, size in
            re.findall(r"kCustomKernel\s+\[[^]]*\]\s+(\w+) grid:.*?shared_memory: (\d+) bytes", open(newest).read())}


def compiled(spec: str, t: int, h: int, kh: int, d: int, dump: str) -> list[dict]:
    """Each Triton kernel of `spec` (as `kernels`), with what XLA's GPU compiler made of it for an
    H100: compile seconds (the whole call's), shared KiB, registers, spilled bytes. A kernel whose
    name XLA repeats (the two-level PaTH forms run the across kernel at both levels) is matched
    to XLA's copies (name, name__1, ...) in order."""
    found = kernels(spec, t, h, kh, d)
    fn, args = attention_grad(spec, t, h, kh, d)
    log = os.path.join(dump, "ptxas.log")
    start = time.perf_counter()
    with stderr_to(log):
        compiled_for(fn, *args, topology="h100:1")
    seconds = time.perf_counter() - start
    reports, shared = ptxas_reports(open(log).read()), shared_memory(dump)
    copies: dict[str, int] = {}
    for kernel in found:
        n = copies[kernel["name"]] = copies.get(kernel["name"], -1) + 1
        xla_name = kernel["name"] + (f"__{n}" if n else "")
        report = reports.get(xla_name, [{"registers": None, "spill_bytes": None}])[0]
        kernel.update(report, xla_name=xla_name, seconds=seconds, shared_kib=shared.get(xla_name, 0) / 1024)
    return found


def table(rows: list[dict]) -> str:
    lines = ["| scheme | kernel | warps / stages | IR lines | reductions | call's compile s | shared KiB | registers | "
             "spilled bytes |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['kernel']} | {r['num_warps']} / {r['num_stages']} | {r['lines']} | "
                     f"{r['reductions']} | {r['seconds']:.1f} | {r['shared_kib']:.1f} | {r['registers']} | "
                     f"{r['spill_bytes']} |")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}; flags only")
    dump = tempfile.mkdtemp(prefix="triton_compile_")
    # Read by XLA when the CUDA plugin loads (lab.lowering.gpu_topology), after this point.
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
    os.environ["TF_CPP_VMODULE"] = "subprocess_compilation=2"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_gpu_ptx_compiler_extra_flags=-v "
                               f"--xla_dump_to={dump}")
    jax.config.update("jax_enable_compilation_cache", False)
    cli.quiet()
    rows = []
    for name in FLAGS.schemes:
        with max_registers(FLAGS.maxnreg):
            found = compiled(name, FLAGS.tokens, FLAGS.heads, FLAGS.kv_heads, FLAGS.head_dim, dump)
        for i, kernel in enumerate(found):
            rows.append({"scheme": name, "kernel": f"{i + 1} of {len(found)}: {kernel['xla_name']}",
                         "num_warps": kernel["num_warps"], "num_stages": kernel["num_stages"],
                         "lines": len(kernel["ttir"].splitlines()),
                         "reductions": len(re.findall(r"\btt\.reduce\b(?!\.)", kernel["ttir"])),
                         **{k: kernel[k] for k in ("seconds", "shared_kib", "registers", "spill_bytes")}})
            print(rows[-1], flush=True)
    print(f"\njax {jax.__version__}, XLA's GPU compiler for one H100 (sm_90a), {FLAGS.tokens} tokens, {FLAGS.heads} "
          f"heads on {FLAGS.kv_heads}, head dim {FLAGS.head_dim}, bf16"
          + (f", maxnreg {FLAGS.maxnreg}" if FLAGS.maxnreg else "") + "\n")
    print(table(rows))


if __name__ == "__main__":
    app.run(main)
