"""Train a decoder LM with any registered position scheme.

    python train.py --config configs/default.py:alibi --config.train.steps=500 \
        --config.workdir=runs/alibi

Resumes from the latest complete checkpoint in `<workdir>/checkpoints` when there is one, so
rerunning the same command after a crash or preemption continues the exact same run.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import app, flags, logging
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from ml_collections import config_flags

from data import DataError
from models import sharding
from models.lm import DecoderLM, ModelConfig, token_nll


class TrainingError(Exception):
    """A run that cannot go on; the message says why and where the last good state is."""


# ---- set-up --------------------------------------------------------------------------------

def workdir_of(config) -> str:
    return config.workdir or os.path.join("runs", config.model.scheme)


def model_config(config, vocab_size: int) -> ModelConfig:
    d = config.model.to_dict()
    if d["vocab_size"] and d["vocab_size"] < vocab_size:
        raise ValueError(f"model.vocab_size={d['vocab_size']} is smaller than the tokenizer's vocabulary "
                         f"({vocab_size}): embeddings and per-token tables (learned step angles) must "
                         "cover every token id; leave it 0 to take the tokenizer's")
    d["vocab_size"] = d["vocab_size"] or vocab_size
    return ModelConfig.from_dict(d)


def make_mesh(config) -> jax.sharding.Mesh:
    n = jax.device_count()
    sizes = dict(config.mesh)
    free = [a for a, s in sizes.items() if s == -1]
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if len(free) > 1 or n % fixed:
        raise ValueError(f"mesh {sizes} does not fit {n} devices (at most one axis may be -1)")
    for a in free:
        sizes[a] = n // fixed
    if math.prod(sizes.values()) != n:
        raise ValueError(f"mesh {sizes} uses {math.prod(sizes.values())} devices, but there are {n}")
    # Auto axes: the partitioner propagates shardings from the annotated inputs and outputs.
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes),
                         axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))


def make_optimizer(cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup_steps, max(cfg.steps, cfg.warmup_steps + 1), cfg.lr * cfg.min_lr_ratio)
    # Decay matrices only: norms' scales and 1-D parameters keep their values.
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                    mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    ), schedule


PARAM_DTYPES = ("float32", "bfloat16")


def stored(params, cfg):
    """Parameters in their storage dtype `train.param_dtype` (the optimizer state stays fp32;
    runs saved before the field existed stored float32)."""
    dtype = cfg.get("param_dtype", "float32")
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"train.param_dtype={dtype!r}; valid: {', '.join(PARAM_DTYPES)}")
    return jax.tree.map(lambda x: x.astype(dtype), params)


def apply_optimizer(tx, grads, opt_state, params):
    """One optimizer update in fp32 whatever the parameters' storage dtype: gradients and
    parameters are widened, the moments are fp32, and the new parameters are rounded back to
    their storage dtype (bf16 storage keeps no fp32 master copy, so an update smaller than
    bf16's spacing at a weight is lost; keep float32 storage and model.dtype="bfloat16" for
    bf16 compute over fp32 masters)."""
    widen = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)  # noqa: E731
    p32 = widen(params)
    updates, opt_state = tx.update(widen(grads), opt_state, p32)
    new = optax.apply_updates(p32, updates)
    return jax.tree.map(lambda x, p: x.astype(p.dtype), new, params), opt_state


def init_state(config, vocab_size, mesh):
    """Model structure and a sharded train state {'params', 'opt_state', 'step'}."""
    model = DecoderLM(model_config(config, vocab_size), rngs=nnx.Rngs(config.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    tx, schedule = make_optimizer(config.train)
    state = {"params": stored(params, config.train), "opt_state": tx.init(params),
             "step": jnp.zeros((), jnp.int32)}
    # Optimizer moments end in their parameter's path, hence get its sharding; counters replicate.
    state = jax.device_put(state, sharding.state_shardings(mesh, state))
    return graphdef, rest, tx, schedule, state


def make_loss(graphdef, rest, config):
    """The training loss (params, batch, rng) -> mean next-token NLL over the scored tokens."""
    def loss_fn(params, batch, rng):
        model = nnx.merge(graphdef, params, rest)
        nll, w = token_nll(model, batch["tokens"], segment_ids=batch["segment_ids"],
                           positions=batch["positions"], impl=config.model.attention_impl, rng=rng)
        if "loss_mask" in batch:  # a synthetic task: only its answers are scored
            w = w * batch["loss_mask"][:, 1:]
        return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)

    return loss_fn


def make_train_step(graphdef, rest, tx, config, state_shardings, batch_sharding):
    loss_fn = make_loss(graphdef, rest, config)

    def step(state, batch):
        # Random position features get a fresh draw every step, reproducible from the seed.
        rng = jax.random.fold_in(jax.random.key(config.seed), state["step"])
        with sharding.activation_rules(batch_sharding.mesh):  # activations over the mesh as well
            loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch, rng)
        params, opt_state = apply_optimizer(tx, grads, state["opt_state"], state["params"])
        finite = jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(params)]))
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "params_finite": finite}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, None), donate_argnums=0)


# ---- checkpoints ---------------------------------------------------------------------------

def checkpoint_manager(directory: str, keep: int = 2, create: bool = True) -> ocp.CheckpointManager:
    # Synchronous saves: a save has finished (and was renamed into place atomically by orbax)
    # before training continues, so a crash can only ever lose the save in progress.
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def save(manager, state, loader_state: dict, meta: dict) -> None:
    step = int(state["step"])
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), loader=ocp.args.JsonSave(loader_state),
        meta=ocp.args.JsonSave(meta)), force=True)


def restore_latest(manager, abstract_state, partial: bool = False):
    """Restore the newest checkpoint that reads back completely, or None if there is none.

    Returns (step, {'state', 'loader', 'meta'}). With `partial`, only the subtree given in
    `abstract_state` is read (e.g. {'params': ...}) and only 'state' is returned. A checkpoint
    that fails to restore (partially written, corrupted) is skipped with a warning and the
    one before it is used.
    """
    if partial:
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
        args = {"state": ocp.args.PyTreeRestore(item=abstract_state, restore_args=restore_args,
                                                partial_restore=True)}
    else:
        args = {"state": ocp.args.StandardRestore(abstract_state), "loader": ocp.args.JsonRestore(),
                "meta": ocp.args.JsonRestore()}
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            return step, manager.restore(step, args=ocp.args.Composite(**args))
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped, loudly
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"warning: skipping unreadable checkpoint at step {step} in {manager.directory}: "
                  f"{reason[:200]}", file=sys.stderr)
    return None


def load_params(directory: str, abstract_params):
    """(step, parameters) of the latest complete checkpoint of a run (for eval and init_from).

    `directory` is a run's workdir or its `checkpoints` folder.
    """
    ckpt_dir = os.path.join(directory, "checkpoints")
    ckpt_dir = ckpt_dir if os.path.isdir(ckpt_dir) else directory
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    found = restore_latest(checkpoint_manager(ckpt_dir, create=False), {"params": abstract_params},
                           partial=True)
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint in {ckpt_dir!r}")
    step, restored = found
    return step, restored["state"]["params"]


# ---- the loop ------------------------------------------------------------------------------

class _Stop:
    """Set by SIGTERM/SIGINT; the loop saves a checkpoint at the next step boundary and exits."""

    def __init__(self):
        self.signal = None

    def __call__(self, signum, frame):
        self.signal = signal.Signals(signum).name


def _mesh_and_batch(config):
    """The device mesh and the batch's sharding (rows over data x fsdp)."""
    mesh = make_mesh(config)
    n_batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if config.batch_size % n_batch_shards:
        raise ValueError(f"batch_size={config.batch_size} is not divisible by the {n_batch_shards} "
                         "data x fsdp devices")
    return mesh, NamedSharding(mesh, P(("data", "fsdp")))


def dry_run(config: ml_collections.ConfigDict) -> dict:
    """Compile the sharded train step of `config` on abstract inputs, allocating and running
    nothing: the parameter count and XLA's memory analysis of the program each device runs."""
    mesh, batch_sharding = _mesh_and_batch(config)
    if config.model.vocab_size:
        vocab = config.model.vocab_size
    else:
        from data import pipeline
        vocab = pipeline.tokenizer(config.data).vocab_size
    cfg = model_config(config, vocab)
    model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(config.seed)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rest = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), rest)
    params = nnx.to_pure_dict(params)
    tx, _ = make_optimizer(config.train)
    state = {"params": jax.eval_shape(lambda p: stored(p, config.train), params),
             "opt_state": jax.eval_shape(tx.init, params),
             "step": jax.ShapeDtypeStruct((), jnp.int32)}
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                         sharding.state_shardings(mesh, state))
    row = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32, sharding=batch_sharding)
    batch = {"tokens": row, "segment_ids": row, "positions": row}
    step = make_train_step(graphdef, rest, tx, config, jax.tree.map(lambda x: x.sharding, state),
                           batch_sharding)
    mem = step.lower(state, batch).compile().memory_analysis()
    out = {"devices": jax.device_count(), "mesh": dict(mesh.shape),
           "params": sum(math.prod(x.shape) for x in jax.tree.leaves(params)),
           "argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
           "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes}
    # Donated state is aliased to the output: it is counted once.
    out["total_bytes"] = out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
    return out


def dry_run_report(r: dict) -> str:
    gib = lambda b: f"{b / 2 ** 20:,.1f} MiB"  # noqa: E731
    return "\n".join([
        f"dry run: {r['devices']} devices, mesh {r['mesh']}, {r['params']:,} parameters",
        "per device (XLA memory analysis of the compiled train step):",
        f"  arguments {gib(r['argument_bytes'])}, outputs {gib(r['output_bytes'])} "
        f"(aliased to arguments {gib(r['alias_bytes'])}), temporaries {gib(r['temp_bytes'])}",
        f"  total {gib(r['total_bytes'])}"])


def train(config: ml_collections.ConfigDict) -> dict:
    """Run (or resume) training. Returns a summary dict. Raises TrainingError on divergence."""
    from data import pipeline  # grain and TFDS are imported only when data is needed

    workdir = workdir_of(config)
    os.makedirs(workdir, exist_ok=True)
    tokenizer = pipeline.tokenizer(config.data)
    mesh, batch_sharding = _mesh_and_batch(config)
    graphdef, rest, tx, schedule, state = init_state(config, tokenizer.vocab_size, mesh)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    train_step = make_train_step(graphdef, rest, tx, config, state_shardings, batch_sharding)

    loader = pipeline.train_loader(config.data, seed=config.seed, batch_size=config.batch_size,
                                   seq_len=config.seq_len + 1)
    manager = checkpoint_manager(os.path.join(workdir, "checkpoints"), config.train.keep_checkpoints)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    found = restore_latest(manager, abstract)
    if found is not None:
        step0, restored = found
        state = restored["state"]
        loader.set_state(restored["loader"])
        print(f"resumed from step {step0} in {workdir}")
    elif config.init_from:
        step0 = 0
        src_step, params = load_params(config.init_from, abstract["params"])
        state = {**state, "params": params}
        print(f"initialised parameters from {config.init_from} (step {src_step})")
        if config.train.steps == 0:  # zero-shot: the loaded parameters under this run's config
            save(manager, state, loader.get_state(), {"step": 0, "loss": float("nan")})
    else:
        step0 = 0
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))

    stop = _Stop()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    writer = _tensorboard(workdir)
    steps = config.train.steps
    tokens_per_step = config.batch_size * config.seq_len
    progress = _progress(step0, steps)
    last_good = manager.latest_step()
    t_log, n_log, history = time.perf_counter(), 0, []
    try:
        for step in range(step0 + 1, steps + 1):
            batch = {k: jax.device_put(np.asarray(v), batch_sharding) for k, v in next(loader).items()}
            new_state, metrics = train_step(state, batch)
            loss = float(metrics["loss"])  # one host sync per step: the NaN guard needs it
            if not (math.isfinite(loss) and bool(metrics["params_finite"])):
                what = f"loss became {loss}" if not math.isfinite(loss) else "parameters became nan/inf"
                raise TrainingError(
                    f"{what} at step {step}; nothing was saved after it. Last good "
                    f"checkpoint: step {last_good} in {manager.directory}. Lower train.lr or "
                    "raise train.warmup_steps and rerun (it resumes from that checkpoint).")
            state = new_state
            history.append(loss)
            n_log += 1
            progress(step, loss)
            if step % config.train.log_every == 0 or step == steps:
                elapsed = time.perf_counter() - t_log
                record = {"step": step, "loss": loss, "grad_norm": float(metrics["grad_norm"]),
                          "lr": float(schedule(step - 1)), "tokens_per_s": n_log * tokens_per_step / elapsed,
                          "time": time.time()}
                if config.train.eval_every and step % config.train.eval_every == 0:
                    record.update(_validation(config, graphdef, rest, state["params"]))
                _log(metrics_path, writer, record)
                progress.tokens_per_s = record["tokens_per_s"]
                progress.log(record)
                t_log, n_log = time.perf_counter(), 0
            if step % config.train.checkpoint_every == 0 or step == steps or stop.signal:
                save(manager, state, loader.get_state(), {"step": step, "loss": loss})
                last_good = step
            if stop.signal:
                print(f"\nstopped by {stop.signal} at step {step}; checkpoint saved in "
                      f"{manager.directory}. Rerun the same command to resume.")
                break
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        progress.close()
        if writer is not None:
            writer.close()
        manager.close()
    return {"workdir": workdir, "step": int(state["step"]), "losses": history,
            "interrupted": stop.signal is not None}


def _validation(config, graphdef, rest, params) -> dict:
    """{'val_loss'} at the training length, or for a synthetic task {'val_loss', 'val_acc'} on
    its answers (eval.task_examples validation examples; 0: all of them)."""
    from data import tasks
    from eval import perplexity_at, task_accuracy_at
    model = nnx.merge(graphdef, params, rest)
    if tasks.is_task(config.data):
        r = task_accuracy_at(config, model, "validation", config.eval.get("task_examples", 0))
        return {"val_loss": r["nll"], "val_acc": r["accuracy"]}
    return {"val_loss": math.log(perplexity_at(config, model, config.seq_len, config.train.eval_tokens))}


def _log(path, writer, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if writer is not None:
        for k, v in record.items():
            if k not in ("step", "time"):
                writer.add_scalar(k, v, record["step"])
        writer.flush()


def _tensorboard(workdir):
    try:
        from tensorboardX import SummaryWriter
    except ImportError:  # TensorBoard logging is optional
        return None
    return SummaryWriter(os.path.join(workdir, "tensorboard"))


def _progress(start, total):
    """A progress bar with loss and tokens/s on stderr (tqdm), or nothing when not a tty."""
    from tqdm import tqdm
    bar = tqdm(total=total, initial=start, disable=not sys.stderr.isatty(), unit="step",
               dynamic_ncols=True)

    def update(step, loss):
        bar.update(step - bar.n)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{update.tokens_per_s:,.0f}", refresh=False)

    def log_line(record):  # without a terminal, one line per logged step instead
        if bar.disable:
            print(f"step {record['step']}/{total}  loss {record['loss']:.4f}  "
                  f"{record['tokens_per_s']:,.0f} tok/s", flush=True)

    update.tokens_per_s = 0.0
    update.close = bar.close
    update.log = log_line
    return update


# ---- command line --------------------------------------------------------------------------

# New attributes are accepted so that scheme options need no placeholder in the config files
# (--config.model.scheme_options.base=5e5); `check_overrides` rejects any other new field.
_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "experiment config",
                                          lock_config=False, accept_new_attributes=True)
OPEN_FIELDS = ("model.scheme_options.", "model.mixer_options.")


def check_overrides(config_path: str, override_paths) -> None:
    """Raise if an override names a field the config file does not have (a typo, say), except
    under the open option dicts (the scheme checks its own options)."""
    import importlib.util
    file, _, arg = config_path.partition(":")
    spec = importlib.util.spec_from_file_location("_config_file", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    base = module.get_config(arg) if arg else module.get_config()
    for path in override_paths:
        if path.startswith(OPEN_FIELDS):
            continue
        node = base
        for key in path.split("."):
            if not isinstance(node, ml_collections.ConfigDict) or key not in node:
                raise ValueError(f"unknown config field {path!r} (from --config.{path}); "
                                 f"see {file} and configs/default.py for the fields")
            node = node[key]


def run_cli(fn):
    """Run fn(); expected failures print one readable line and exit non-zero."""
    try:
        return fn()
    except (TrainingError, DataError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax is chatty at INFO
    flag = flags.FLAGS["config"]
    run_cli(lambda: check_overrides(config_flags.get_config_filename(flag),
                                    config_flags.get_override_values(flag)))
    if _CONFIG.value.get("dry_run"):
        print(dry_run_report(run_cli(lambda: dry_run(_CONFIG.value))))
        return
    summary = run_cli(lambda: train(_CONFIG.value))
    losses = summary["losses"]
    if losses:
        print(f"done: step {summary['step']}, final loss {losses[-1]:.4f}, workdir {summary['workdir']}")


if __name__ == "__main__":
    app.run(main)
