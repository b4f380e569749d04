"""Trained runs: load one from disk (config, model with its newest complete checkpoint, step),
hold one in memory (`Run`: what the evaluators take, besides workdirs), name it in reports,
read its held-out text, and the plotting backend the reports share."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import matplotlib
import ml_collections
import numpy as np
from flax import nnx

from data import pipeline
from lab import files
from lab.checkpoints import load_params
from lab.state import init_state, make_mesh, model_config, stored
from models.lm import DecoderLM

matplotlib.use("Agg")  # reports are written to files; no display is needed or wanted


def load_run(workdir: str, untrained: bool = False, param_dtype: str | None = None, fsdp: int = 1, tensor: int = 1,
             dtype: str | None = None):
    """(config, model with the latest complete checkpoint's parameters, step) of a training run;
    with `untrained`, the model as its config initialises it (seed included), step 0.
    `param_dtype` ("bfloat16", "float32"): the parameters cast to it as they are read (half the
    memory of an fp32 checkpoint in bf16); None: as the checkpoint stores them. `fsdp` and
    `tensor`: the devices the parameters are split over (-1: all; the rest of the devices
    split the batch), each device reading only its shard; 1 and 1: a copy on every device.
    `dtype`: the compute dtype (model.dtype) to evaluate in; None: the run's."""
    if untrained:  # the parameters as the config initialises them (no optimizer state)
        config = run_config(workdir)
        vocab = config.model.vocab_size or pipeline.tokenizer(config.data).vocab_size
        graphdef, params, rest = nnx.split(DecoderLM(model_config(config, vocab), rngs=nnx.Rngs(config.seed)),
                                           nnx.Param, ...)
        return config, nnx.merge(graphdef, stored(nnx.to_pure_dict(params), config.train), rest), 0
    # The model's structure from abstract shapes, then the checkpoint's parameters read into it,
    # each device reading its shard: about the memory of the weights (no initialisation, no
    # optimizer state).
    config, graphdef, rest, abstract = abstract_run(workdir, param_dtype, fsdp, tensor, dtype=dtype)
    check_fits(workdir, abstract)
    step, params = load_params(workdir, abstract)
    return config, nnx.merge(graphdef, params, rest), step


def run_config(workdir: str) -> ml_collections.ConfigDict:
    """A run's config.json, with its tokenizer's path where an imported run now keeps it."""
    path = files.join(workdir, "config.json")
    if not files.path(path).is_file():
        raise FileNotFoundError(f"{workdir!r} is not a training run directory (no config.json); "
                                "pass the --config.workdir of a train.py run")
    try:
        config = ml_collections.ConfigDict(json.loads(files.read_text(path)))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or restore the file (train.py writes it when "
                         f"a run starts)") from None
    own = files.join(workdir, "tokenizer")  # an imported run's copy of its tokenizer, where it now is
    if config.data.get("tokenizer") == "hf" and not files.path(config.data.tokenizer_path).exists() \
            and files.path(own).exists():
        config.data.tokenizer_path = own
    return config


def abstract_run(workdir: str, param_dtype: str | None = None, fsdp: int = 1, tensor: int = 1, devices=None,
                 dtype: str | None = None):
    """(config, graphdef, rest, parameters as sharded ShapeDtypeStructs) of a run, from its
    config.json alone (nothing read, nothing allocated), over `devices` (default: the job's),
    with `load_run`'s options."""
    config = run_config(workdir)
    config.mesh = ml_collections.ConfigDict(dict(data=1 if -1 in (fsdp, tensor) else -1, fsdp=fsdp, tensor=tensor))
    config.model.dtype = dtype or config.model.dtype
    vocab = config.model.vocab_size or pipeline.tokenizer(config.data).vocab_size
    graphdef, rest, _, _, state = init_state(config, vocab, make_mesh(config, devices), abstract=True)
    abstract = state["params"]
    if param_dtype is not None:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(param_dtype), sharding=x.sharding),
                                abstract)
    return config, graphdef, rest, abstract


def device_memory() -> int | None:
    """Bytes one device can hold: the accelerator's limit, this host's memory on a CPU (None
    where neither is known)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    if jax.default_backend() == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def check_fits(workdir: str, abstract_params) -> None:
    """One ValueError line, before anything is read, where a run's parameters alone (per device,
    as they are sharded) do not fit in a device's memory."""
    need = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(abstract_params))
    have = device_memory()
    if have is not None and need > have:
        count = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params))
        raise ValueError(f"{workdir}: its {count:,} parameters need {need / 2 ** 30:.2f} GiB per device, over the "
                         f"{have / 2 ** 30:.2f} GiB of a {jax.local_devices()[0].device_kind} device; evaluate it "
                         f"on a device with more memory")


@dataclasses.dataclass(frozen=True)
class Run:
    """A run in memory: `load_run`'s (config, model, step) with the directory it belongs to.
    Evaluators take these beside workdirs, so training can evaluate its live model."""
    workdir: str
    config: ml_collections.ConfigDict
    model: nnx.Module
    step: int

    def identity(self) -> dict:
        """What an evaluator's report says of the run: workdir, step, scheme, and the experiment
        arm and seed of its config (lab/sweep.py sets the arm; '' where none was), by which
        lab/results/seeds.py groups seeds."""
        return {"workdir": self.workdir, "step": self.step, "scheme": self.config.model.scheme,
                "arm": self.config.get("arm", ""), "seed": self.config.seed}


def with_scheme(run: Run, scheme: str, options: dict | None = None) -> Run:
    """`run` zero-shot under another position scheme: its config with model.scheme = `scheme`
    and its scheme options updated by `options`, its parameters in the model that config
    builds (LM-Infinite's window, unless given, is the run's training length: `model_config`).
    A scheme whose model has other parameters than the run's is refused, one line."""
    config = ml_collections.ConfigDict(run.config.to_dict())
    config.model.scheme = scheme
    if config.get("arm"):  # not the arm it was trained as: reports must not pool it with that arm's seeds
        config.arm = f"{config.arm} under {scheme}"
    config.model.scheme_options = {**config.model.get("scheme_options", {}), **(options or {})}
    cfg = model_config(config, run.model.cfg.vocab_size)
    graphdef, wanted = nnx.split(nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0))))
    state = nnx.state(run.model)
    have, need = _shapes(state), _shapes(wanted)
    if have != need:
        path = min(set(have.items()) ^ set(need.items()))[0]
        why = (f"{path} is {have[path]} in the run, {need[path]} under it" if path in have and path in need else
               f"it needs {path} {need[path]}, which the run lacks" if path in need else
               f"it has no place for the run's {path}")
        raise ValueError(f"{run.workdir}: scheme {scheme!r} does not fit the run's parameters ({why}); a zero-shot "
                         "scheme must take them as they are")
    return Run(run.workdir, config, nnx.merge(graphdef, state), run.step)


def _shapes(state) -> dict:
    """{'blocks/0/attn/q/kernel': shape} of a model's state."""
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path[:-1]): tuple(x.shape)
            for path, x in jax.tree_util.tree_leaves_with_path(state)}


@dataclasses.dataclass(frozen=True)
class Pending:
    """A run to be loaded when an evaluator reaches it, with `load_run`'s options."""
    workdir: str
    param_dtype: str | None = None
    fsdp: int = 1
    tensor: int = 1
    dtype: str | None = None

    def load(self) -> Run:
        return Run(self.workdir, *load_run(self.workdir, param_dtype=self.param_dtype, fsdp=self.fsdp,
                                           tensor=self.tensor, dtype=self.dtype))


def named_runs(runs, untrained: bool = False):
    """(name in reports, Run) for each of `runs` (workdirs, Pending or Runs), loaded only when
    it is reached (one model in memory at a time for a caller that loops); with `untrained`,
    then a freshly initialised copy of the first run's model, '<its name> (untrained)'."""
    runs = [Pending(r) if isinstance(r, str) else r for r in runs]
    workdirs = [r.workdir for r in runs]
    for run in runs:
        yield run_name(run.workdir, workdirs), run if isinstance(run, Run) else run.load()
    if untrained:
        yield (f"{run_name(workdirs[0], workdirs)} (untrained)",
               Run(workdirs[0], *load_run(workdirs[0], untrained=True)))


def run_name(workdir: str, workdirs) -> str:
    """A run's name in reports: its folder name, with as many parent folders as it takes to
    tell it apart from the other runs compared (runs/a/tapa vs runs/b/tapa -> a/tapa, b/tapa).
    A folder named seed<k> always keeps its parent, the arm it is a seed of (sessa/seed1)."""
    parts = lambda w: os.path.normpath(w).split(os.sep)  # noqa: E731
    seed_folder = re.fullmatch(r"seed\d+", parts(workdir)[-1]) is not None
    for depth in range(1 + seed_folder, len(parts(workdir)) + 1):
        name = "/".join(parts(workdir)[-depth:])
        if sum("/".join(parts(w)[-depth:]) == name for w in workdirs) == 1:
            return name
    return workdir


@functools.lru_cache(maxsize=4)
def _stream_cached(data_json: str, split: str, max_tokens: int) -> np.ndarray:
    return pipeline.eval_stream(ml_collections.ConfigDict(json.loads(data_json)), split, max_tokens)


def held_out_stream(config, max_tokens: int) -> np.ndarray:
    """The first `max_tokens` tokens of a run's held-out split (cached per data config)."""
    return _stream_cached(config.data.to_json(), config.eval.split, max_tokens)


@functools.lru_cache(maxsize=4)
def _documents_cached(data_json: str, split: str, min_tokens: int, max_tokens: int) -> tuple:
    config, found, total = ml_collections.ConfigDict(json.loads(data_json)), [], 0
    for doc in pipeline.eval_documents(config, split):
        if total >= max_tokens:
            break
        if len(doc) >= min_tokens:
            found.append(doc)
            total += len(doc)
    return tuple(found)


def held_out_documents(config, min_tokens: int, max_tokens: int) -> tuple:
    """The first documents of a run's held-out split that have at least `min_tokens` tokens (EOS
    included), until they hold `max_tokens`; fewer where the split runs out (cached)."""
    return _documents_cached(config.data.to_json(), config.eval.split, min_tokens, max_tokens)


def held_out_windows(config, windows: int, length: int) -> jax.Array:
    """The first `windows` held-out windows of `length` tokens: [windows, length]."""
    tokens = held_out_stream(config, windows * length + 1)
    return jnp.asarray(tokens[:windows * length].reshape(windows, length))


def pyplot():
    """matplotlib.pyplot, on the file backend."""
    import matplotlib.pyplot as plt  # only once a report is drawn: it is slow to import
    return plt
