"""The train state of a run and its one initialisation path, shared by training, the dry run
and loading a run: the model config from a run config, the device mesh, the optimizer, and
{'params', 'opt_state', 'step'} with its shardings, abstract (nothing allocated) or built;
and the train step itself (`make_train_step`). It imports no data pipeline, so the step runs
where only JAX, Flax, optax and ml-collections are installed (benchmarks/gpu_check.py).
"""

from __future__ import annotations

import functools
import math
import operator
import os

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from data.batch import DTYPES, REQUIRED
from lab import distributed
from models import sharding
from models.lm import DecoderLM, ModelConfig, token_nll
from models.registry import get_entry


def workdir_of(config) -> str:
    return config.workdir or os.path.join("runs", config.model.scheme)


COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


def check_config(config) -> None:
    """Raise ValueError naming the first field whose value cannot work (the field, its value,
    what is valid), so that a bad value stops a run before it creates its workdir, prepares
    data or compiles; the model's own consistency (head counts, remat) is ModelConfig's check."""
    # Zero steps with init_from stores its parameters under this config (a zero-shot extension).
    least = {"seq_len": 1, "batch_size": 1, "train.steps": 0 if config.init_from else 1,
             "train.warmup_steps": 0, "train.log_every": 1, "train.checkpoint_every": 1,
             "train.keep_checkpoints": 1, "train.eval_every": 0,
             "model.d_model": 1, "model.num_layers": 1, "model.num_heads": 1}
    for field, low in least.items():
        value = functools.reduce(operator.getitem, field.split("."), config)
        if value < low:
            zero_shot = " (0 with init_from: its parameters stored under this config)" if field == "train.steps" else ""
            raise ValueError(f"{field}={value!r}; valid: an integer >= {low}{zero_shot}")
    if not config.train.lr > 0:
        raise ValueError(f"train.lr={config.train.lr!r}; valid: a number > 0")
    if not (config.train.explode_factor == 0 or config.train.explode_factor > 1):
        raise ValueError(f"train.explode_factor={config.train.explode_factor!r}; valid: a number > 1, or 0 "
                         "for no loss-explosion check")
    for axis, size in config.mesh.items():
        if size < 1 and size != -1:
            raise ValueError(f"mesh.{axis}={size!r}; valid: an integer >= 1, or -1 for the devices "
                             "left over (one axis at most)")
    if config.model.dtype not in COMPUTE_DTYPES:
        raise ValueError(f"model.dtype={config.model.dtype!r}; valid: {', '.join(COMPUTE_DTYPES)}")
    distributed.check(config.get("distributed"))
    cfg = ModelConfig.from_dict(config.model.to_dict())
    for layer in cfg.layers:
        layer.make_scheme(cfg.num_heads, cfg.resolved_head_dim)


def check_windows(config) -> None:
    """For training: raise naming the first layer whose sliding window or attention chunk holds
    its whole training context (seq_len), where it would never act (an imported or evaluated run
    may have one: it acts past seq_len there)."""
    cfg = ModelConfig.from_dict(config.model.to_dict())
    for i, layer in enumerate(cfg.layers):
        for field, size in (("window", layer.window), ("chunk", layer.chunk)):
            if size >= config.seq_len:
                where = f"model.layer_kinds.{cfg.layer_kind(i)}" if cfg.layer_kind(i) else "model"
                raise ValueError(f"{where}.{field}={size} (layer {i}) is not below seq_len={config.seq_len}: every "
                                 f"query's {field} holds its whole context, so training sees none; set a {field} "
                                 f"below {config.seq_len}, or 0 for none")


def model_config(config, vocab_size: int) -> ModelConfig:
    """The ModelConfig of a run config; the scheme's `train_len_options` it leaves unset take the
    training length, config.seq_len (LM-Infinite's window)."""
    d = config.model.to_dict()
    lengths = {name: config.seq_len for name in get_entry(d["scheme"]).scheme_cls.train_len_options}
    d["scheme_options"] = {**lengths, **d.get("scheme_options", {})}
    if d["vocab_size"] and d["vocab_size"] < vocab_size:
        raise ValueError(f"model.vocab_size={d['vocab_size']} is smaller than the tokenizer's vocabulary "
                         f"({vocab_size}): embeddings and per-token tables (learned step angles) must "
                         "cover every token id; leave it 0 to take the tokenizer's")
    d["vocab_size"] = d["vocab_size"] or vocab_size
    return ModelConfig.from_dict(d)


def make_mesh(config, devices=None) -> jax.sharding.Mesh:
    """The config's mesh over `devices` (default: every device of the job)."""
    n = len(devices) if devices is not None else jax.device_count()
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
                         axis_types=(jax.sharding.AxisType.Auto,) * len(sizes), devices=devices)


def make_optimizer(cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup_steps, max(cfg.steps, cfg.warmup_steps + 1), cfg.lr * cfg.min_lr_ratio)
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                    mask=functools.partial(decayed, position=cfg.get("decay_position_params", True))),
    ), schedule


def decayed(params, position: bool = True):
    """Which parameters weight decay pulls towards 0 (a tree of bools): matrices only, not norms'
    scales or other 1-D parameters; and, only with `position`, the position schemes' learned
    matrices (step tables, FoX gate and PaTH projections, ESPR generators: the `features` of
    an attention layer), which decay would pull towards a fixed
    scheme (a step table towards RoPE's constant angles)."""
    def decay(path, x):
        names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
        return x.ndim >= 2 and (position or "features" not in names)
    return jax.tree_util.tree_map_with_path(decay, params)


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


def mesh_and_batch(config, devices=None):
    """The device mesh and the batch's sharding (rows over data x fsdp)."""
    mesh = make_mesh(config, devices)
    n_batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if config.batch_size % n_batch_shards:
        raise ValueError(f"batch_size={config.batch_size} is not divisible by the {n_batch_shards} "
                         "data x fsdp devices")
    return mesh, NamedSharding(mesh, P(("data", "fsdp")))


def init_state(config, vocab_size: int, mesh, *, abstract: bool = False):
    """(graphdef, rest, tx, schedule, state) of a run: the model structure, its non-parameter
    state, the optimizer and schedule, and the train state {'params', 'opt_state', 'step'}
    sharded over `mesh` (optimizer moments end in their parameter's path, hence get its
    sharding; counters replicate). With `abstract`, state is ShapeDtypeStructs carrying their
    shardings and nothing of it is allocated (the dry run, and the shapes a restore reads
    into); rest, small, is built either way.

    The concrete state is built eagerly, then placed. Under jit, XLA fuses the initialisers'
    arithmetic and the parameters move by an ulp, which would change every committed result; an
    eager build keeps them bit for bit.
    """
    cfg = model_config(config, vocab_size)
    tx, schedule = make_optimizer(config.train)

    def build():
        graphdef, params, rest = nnx.split(DecoderLM(cfg, rngs=nnx.Rngs(config.seed)), nnx.Param, ...)
        params = nnx.to_pure_dict(params)
        return graphdef, {"params": stored(params, config.train), "opt_state": tx.init(params),
                          "step": jnp.zeros((), jnp.int32)}, rest

    if abstract:
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(config.seed))))
        state, rest = jax.eval_shape(lambda: build()[1:])
        if jax.tree.leaves(rest):  # small non-parameter state (random-feature keys), built for real:
            rest = jax.jit(lambda: build()[2])()  # the parameters' initialisers are dead code there
        shardings = sharding.state_shardings(mesh, state)
        state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
        return graphdef, rest, tx, schedule, state
    graphdef, state, rest = build()
    return graphdef, rest, tx, schedule, jax.device_put(state, sharding.state_shardings(mesh, state))


def make_loss(graphdef, rest, config):
    """The training loss (params, batch, rng) -> mean next-token NLL over the scored tokens."""
    def loss_fn(params, batch, rng):
        model = nnx.merge(graphdef, params, rest)
        nll, w = token_nll(model, batch["tokens"], segment_ids=batch["segment_ids"],
                           positions=batch["positions"], impl=config.model.attention_impl, rng=rng)
        if "loss_weight" in batch:  # a synthetic task scores only its answers; a retrieval mix
            w = w * batch["loss_weight"][:, 1:]  # may weight its answers up (data.batch)
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


def abstract_train_step(config: ml_collections.ConfigDict, vocab_size: int, devices=None, keys=REQUIRED):
    """(the jitted train step of `config`, its abstract arguments (state, batch), the mesh) over
    `devices` (default: the job's), every array a ShapeDtypeStruct: nothing is allocated. The
    batch has `keys` (`data.pipeline.batch_keys(config.data)`: those training feeds)."""
    check_config(config)
    mesh, batch_sharding = mesh_and_batch(config, devices)
    graphdef, rest, tx, _, state = init_state(config, vocab_size, mesh, abstract=True)
    batch = {k: jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), DTYPES[k], sharding=batch_sharding)
             for k in keys}
    step = make_train_step(graphdef, rest, tx, config, jax.tree.map(lambda x: x.sharding, state), batch_sharding)
    return step, (state, batch), mesh
