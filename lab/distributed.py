"""Several processes, one run: the start-up of a multi-process job, the check that every process
runs the same config, and which rows of the global batch this process loads.

A job has several processes when JAX detects a cluster that launched it (a Cloud TPU pod slice,
SLURM, Open MPI, Kubernetes: `jax.distributed.initialize` with no arguments), or when the
config says so: `distributed.coordinator` (host:port of process 0), `distributed.num_processes`
and `distributed.process_id`. One process is the default and needs nothing.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import jax
import ml_collections
import numpy as np


class StartupError(Exception):
    """The processes of a job could not start together; the message says why."""


# configs/default.py's `distributed` section (configs may not import lab): what a caller gives no value for.
DEFAULTS = dict(coordinator="", num_processes=0, process_id=-1, timeout_s=300)


def _cluster_detected() -> bool:
    """Whether JAX recognises a cluster launcher in the environment (its own auto-detection)."""
    try:
        from jax._src.clusters import ClusterEnv
        return any(not env.opt_in_only_method and env.is_env_present() for env in ClusterEnv._cluster_types)
    except (ImportError, AttributeError):  # the private API moved: explicit fields still work
        return False


def initialize(d: ml_collections.ConfigDict | dict | None) -> None:
    """`jax.distributed.initialize` for a multi-process job, from a run config's `distributed`
    section (configs/default.py; fields left out take DEFAULTS; None: detection only); a no-op for one process, or when done
    already. Must run before anything touches a device. CPU processes talk through gloo."""
    d = ml_collections.ConfigDict({**DEFAULTS, **(d or {})})
    if jax.distributed.is_initialized() or not (d.coordinator or d.num_processes > 1 or _cluster_detected()):
        return
    if d.num_processes < 0 or (d.num_processes and not -1 <= d.process_id < d.num_processes):
        raise ValueError(f"distributed.process_id={d.process_id} with distributed.num_processes={d.num_processes}; "
                         "valid: 0 <= process_id < num_processes (-1: detected)")
    host, _, port = d.coordinator.rpartition(":")
    if d.coordinator and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"distributed.coordinator={d.coordinator!r}; valid: host:port of process 0, e.g. "
                         "10.0.0.1:1234 (the same on every process)")
    if not d.timeout_s > 0:
        raise ValueError(f"distributed.timeout_s={d.timeout_s!r}; valid: a number of seconds > 0")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    why = (f"the job's processes did not start together within distributed.timeout_s={d.timeout_s} s (coordinator "
           f"{d.coordinator or 'detected'})")
    advice = "Check that the coordinator's host:port is reachable from every process and that every process was launched"
    # JAX aborts the process when its own deadline passes; this watchdog ends it first, in one line.
    watchdog = threading.Timer(d.timeout_s, lambda: (print(f"error: {why}. {advice}", file=sys.stderr, flush=True),
                                                     os._exit(1)))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(coordinator_address=d.coordinator or None, num_processes=d.num_processes or None,
                                   process_id=None if d.process_id < 0 else d.process_id,
                                   initialization_timeout=int(d.timeout_s) + 60)
    except Exception as e:  # noqa: BLE001 - JAX raises several kinds; all mean the job did not start
        raise StartupError(f"{why}: {(str(e).strip().splitlines() or [type(e).__name__])[0][:300]}. {advice}") from None
    finally:
        watchdog.cancel()


def check_same_config(config: ml_collections.ConfigDict) -> None:
    """Raise ValueError in every process, naming the fields, if the processes were given
    different configs (distributed.process_id aside)."""
    mine = json.loads(config.to_json_best_effort())
    mine.get("distributed", {}).pop("process_id", None)
    configs = gather_json(mine)
    differ = [f"process {p}: {d}" for p, c in enumerate(configs) if (d := _diff(configs[0], c))]
    if differ:
        raise ValueError(f"the processes were launched with different configs ({'; '.join(differ)}); "
                         "launch every process with the same flags")


def gather_json(obj) -> list:
    """`obj` (anything JSON can hold) from every process, in process order."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.int32(len(data)))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:len(data)] = data
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[:n])) for row, n in zip(rows, sizes)]


def barrier(name: str) -> None:
    """Wait until every process gets here (nothing to wait for with one)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def _diff(a: dict, b: dict, prefix: str = "") -> str:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out.append(_diff(x, y, f"{prefix}{k}."))
        elif x != y:
            out.append(f"{prefix}{k} {y!r} vs {x!r} on process 0")
    return ", ".join(filter(None, out))


def local_rows(batch_sharding, batch_size: int) -> range:
    """The rows of the global batch that this process's devices hold (contiguous)."""
    spans = sorted({(s[0].start or 0, batch_size if s[0].stop is None else s[0].stop)
                    for s in batch_sharding.addressable_devices_indices_map((batch_size, 1)).values()})
    stop = spans[0][0]
    for a, b in spans:
        if a > stop:
            raise ValueError(f"this process's devices hold rows {spans} of the batch, which are not contiguous")
        stop = max(stop, b)
    return range(spans[0][0], stop)


def batch_sharding_of(model):
    """The sharding a batch for `model` takes: rows over the batch axes (data x fsdp) of the mesh
    its parameters live on, or None for a model on no such mesh (a notebook's, a test's)."""
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    leaf = jax.tree.leaves(nnx.state(model, nnx.Param))[0]
    mesh = getattr(leaf.sharding, "mesh", None)
    if mesh is None or not {"data", "fsdp"} <= set(mesh.axis_names):
        return None
    return NamedSharding(mesh, P(("data", "fsdp")))


def row_multiple(model) -> int:
    """How many rows of a batch for `model` must come in: a whole number per batch shard."""
    sharding = batch_sharding_of(model)
    return 1 if sharding is None else sharding.mesh.shape["data"] * sharding.mesh.shape["fsdp"]


def place_rows(arrays: dict, model) -> dict:
    """Host arrays of rows that every process holds in full ({name: [rows, ...]}), as the inputs
    of a jitted call on `model`: sharded over its batch axes, each process placing only the rows
    its own devices hold (so each scores its own windows); unchanged device arrays otherwise."""
    sharding = batch_sharding_of(model)
    if sharding is None:
        return {k: jax.numpy.asarray(v) for k, v in arrays.items()}
    rows = local_rows(sharding, len(next(iter(arrays.values()))))
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)[rows.start:rows.stop])
            for k, v in arrays.items()}


def place_windows(arrays: dict, model) -> dict:
    """`place_rows` where the rows divide evenly among the batch shards (each process computes
    its own windows), else each array whole on every device of `model`'s mesh (each process
    computes every window, the same on all): for statistics over all the windows (a mean, a
    split into halves), which padding rows would change."""
    sharding = batch_sharding_of(model)
    if sharding is None or len(next(iter(arrays.values()))) % row_multiple(model) == 0:
        return place_rows(arrays, model)
    from jax.sharding import NamedSharding, PartitionSpec as P
    whole = NamedSharding(sharding.mesh, P())
    return {k: jax.make_array_from_process_local_data(whole, np.asarray(v)) for k, v in arrays.items()}


def to_host(x) -> np.ndarray:
    """A jitted call's output as a host array on every process, gathered where it is spread
    over the processes' devices (a host value as it is)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
