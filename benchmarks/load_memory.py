"""Peak host memory of importing, loading and evaluating a pretrained model, against its weights.

    python benchmarks/load_memory.py [--model Llama-3.2-1B] [--dir /tmp/load_memory] [--seq_len 256]
    python benchmarks/load_memory.py --dir /tmp/load_memory_58m \
        --shape=hidden_size=512,intermediate_size=1536,num_hidden_layers=12,num_attention_heads=8,head_dim=64,vocab_size=32000

Writes a checkpoint of `lab.hf.PUBLISHED[--model]`'s shape with random bf16 weights (the
safetensors layout and tensor names transformers' save_pretrained writes for the Llama family,
written here with numpy: no download, no torch), then runs each step in its own process and
reads that process's peak RSS (`os.wait4`): a baseline that imports JAX and the project,
import_checkpoint.py, `lab.runs.load_run` (parameters only), and eval.py's perplexity at half
and the whole --seq_len (4 windows a batch, 2 x --seq_len scored tokens), computing in fp32
(the import's model.dtype) and in bf16 (`--dtype=bfloat16`). Prints each peak, its
excess over the baseline and that excess over the parameters' bytes. On a CPU host the
devices' memory is host memory, so RSS is everything the step held.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
from absl import app, flags

from lab.hf import PUBLISHED

flags.DEFINE_string("model", "Llama-3.2-1B", f"of {', '.join(PUBLISHED)}")
flags.DEFINE_string("dir", "/tmp/load_memory", "where the checkpoint and the run go (reused when there)")
flags.DEFINE_list("shape", [], "config fields (integers) changed from --model's, field=value: a smaller model of its family")
flags.DEFINE_integer("seq_len", 256, "the imported run's training length; eval.py scores half and all of it")
FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def llama_tensors(hf: dict) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a Llama-family checkpoint as transformers names and shapes its tensors."""
    d, heads, kv = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf.get("head_dim") or d // heads
    out = {"model.embed_tokens.weight": (hf["vocab_size"], d), "model.norm.weight": (d,)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (heads * hd, d), p + "self_attn.k_proj.weight": (kv * hd, d),
                    p + "self_attn.v_proj.weight": (kv * hd, d), p + "self_attn.o_proj.weight": (d, heads * hd),
                    p + "mlp.gate_proj.weight": (hf["intermediate_size"], d),
                    p + "mlp.up_proj.weight": (hf["intermediate_size"], d),
                    p + "mlp.down_proj.weight": (d, hf["intermediate_size"]),
                    p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
    if not hf.get("tie_word_embeddings"):
        out["lm_head.weight"] = (hf["vocab_size"], d)
    return out


def write_checkpoint(hf: dict, directory: str) -> int:
    """config.json and model.safetensors of random bf16 weights (norms at 1); the weights' bytes."""
    shapes = llama_tensors(hf)
    header, offset = {}, 0
    for name, shape in shapes.items():
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + 2 * math.prod(shape)]}
        offset += 2 * math.prod(shape)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**hf, "torch_dtype": "bfloat16", "architectures": ["LlamaForCausalLM"]}, f)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(0)
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape in shapes.items():
            x = np.ones(shape, np.float32) if name.endswith("norm.weight") else \
                rng.standard_normal(shape, np.float32) * 0.02
            f.write(x.astype(jnp.bfloat16).tobytes())
    return offset


def peak_rss(args: list[str]) -> int:
    """Peak RSS in bytes of `python args` (from the repository root); exits on its failure."""
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"error: {' '.join(args)[:200]} failed: {err.strip().splitlines()[-1] if err.strip() else '?'}")
    sys.stdout.write("".join(line + "\n" for line in out.splitlines() if line.startswith("|")))
    return usage.ru_maxrss * 1024  # Linux reports KiB


def main(argv):
    del argv
    hf = {**PUBLISHED[FLAGS.model], **{k: int(v) for k, v in (item.split("=", 1) for item in FLAGS.shape)}}
    source, run = os.path.join(FLAGS.dir, "hf"), os.path.join(FLAGS.dir, "run")
    if not os.path.isfile(os.path.join(source, "model.safetensors")):
        write_checkpoint(hf, source)
    weights = os.path.getsize(os.path.join(source, "model.safetensors"))
    steps = {"baseline (import jax, lab, eval.py's modules)":
             ["-c", "import jax, lab.runs, lab.lengths, lab.evaluators; jax.devices()"]}
    if not os.path.isdir(run):
        steps["import_checkpoint.py"] = ["import_checkpoint.py", f"--source={source}", f"--workdir={run}",
                                         f"--seq_len={FLAGS.seq_len}"]
    steps["load_run (parameters only)"] = ["-c", f"from lab.runs import load_run; load_run({run!r})"]
    for dtype in ("float32", "bfloat16"):
        steps[f"eval.py perplexity at {FLAGS.seq_len // 2} and {FLAGS.seq_len}, computing in {dtype}"] = [
            "eval.py", f"--workdirs={run}", "--max_multiplier=1", f"--tokens={2 * FLAGS.seq_len}", f"--dtype={dtype}",
            f"--out={os.path.join(FLAGS.dir, 'eval', dtype)}"]
    print(f"{FLAGS.model}{' with ' + ', '.join(FLAGS.shape) if FLAGS.shape else ''}: {weights / 2 ** 30:.2f} GiB of bf16 weights in {source}")
    baseline = None
    for name, args in steps.items():
        peak = peak_rss(args)
        baseline = peak if baseline is None else baseline
        print(f"{name}: peak RSS {peak / 2 ** 30:.2f} GiB, {(peak - baseline) / 2 ** 30:.2f} GiB over the baseline "
              f"= {(peak - baseline) / weights:.2f} x the weights", flush=True)


if __name__ == "__main__":
    app.run(main)
