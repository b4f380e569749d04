"""Import a Hugging Face checkpoint of the Llama family (Llama 2 / 3.x, Mistral, Qwen2 / 2.5) as
a run directory, which eval.py, lab.runs.load_run and train.py --config.init_from then take.

    python import_checkpoint.py --source=/path/to/Llama-3.2-1B --workdir=runs/llama32-1b
    python eval.py --workdirs=runs/llama32-1b --max_multiplier=4

--source is a local directory with config.json and model.safetensors (or its shards and
model.safetensors.index.json); its tokenizer is copied, and the run reads text with it.
Parameters load sharded over the devices (--fsdp, --tensor); bf16 checkpoints stay bf16. The
run is written beside --workdir in a hidden folder and renamed into place once complete: Ctrl-C
or SIGTERM removes it (exit 130 / 143), and one a killed import left is removed by the next
import into that workdir. The work is done by lab/hf.py.
"""

from __future__ import annotations

import os
import signal
import sys

from absl import app, flags

from lab import cli
from lab.hf import import_checkpoint, train_flags

flags.DEFINE_string("source", "", "Hugging Face checkpoint directory (config.json, *.safetensors)")
flags.DEFINE_string("workdir", "", "the run directory to create (must not exist, or be empty)")
flags.DEFINE_integer("seq_len", 0, "the run's training length, from which eval.py's lengths are multiples "
                     "(0: the checkpoint's max_position_embeddings)")
flags.DEFINE_enum("param_dtype", "", ["", "float32", "bfloat16"], "parameter storage (default: the "
                  "checkpoint's, bf16 or else fp32)")
flags.DEFINE_integer("fsdp", -1, "devices the parameters are split over while importing (-1: all)")
flags.DEFINE_integer("tensor", 1, "devices the heads, MLP and vocabulary are split over while importing")
FLAGS = flags.FLAGS


def require_paths() -> None:
    if not FLAGS.source or not FLAGS.workdir:
        raise ValueError("pass --source=<Hugging Face checkpoint directory> --workdir=<new run directory>")


def main(argv):
    del argv
    cli.quiet()
    cli.raise_on(signal.SIGTERM)  # the unfinished import is removed, as on Ctrl-C
    cli.run_cli(require_paths)
    summary = cli.run_cli(lambda: import_checkpoint(FLAGS.source, FLAGS.workdir, seq_len=FLAGS.seq_len,
                                                    param_dtype=FLAGS.param_dtype, fsdp=FLAGS.fsdp,
                                                    tensor=FLAGS.tensor))
    for line in summary["caveats"]:
        print(f"warning: {line}", file=sys.stderr)
    config, workdir = summary["config"], summary["workdir"]
    print(f"imported {summary['model_type']} ({summary['params']:,} parameters, {config.train.param_dtype}) "
          f"from {FLAGS.source} into {workdir}")
    if tok := summary["tokenizer"]:
        print(f"tokenizer: {os.path.basename(tok.path)} ({tok.kind}, {tok.vocab_size:,} tokens), BOS {tok.bos_id} "
              f"{'before each document' if tok.add_bos else '(not prepended)'}, EOS {tok.eos_id}, PAD {tok.pad_id}")
    print(f"evaluate: python eval.py --workdirs={workdir}")
    print(f"train from it: python train.py --config configs/default.py --config.init_from={workdir} "
          + " ".join(train_flags(config)))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
