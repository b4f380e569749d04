"""Several processes, one run: the start-up of a multi-process job, the check that every process
runs the same config, and which rows of the global batch this process loads.

A job has several processes when JAX detects a cluster that launched it (a Cloud TPU pod slice,
SLURM, Open MPI, Kubernetes: `jax.distributed.initialize` with no arguments), or when the
config says so: `distributed.coordinator` (host:port of process 0), `distributed.num_processes`
and `distributed.process_id`. One process is the default and needs nothing.

A job fails whole and fast: a process that fails tells the others through the coordination
service's key-value store (`end`) and exits at once, without waiting in JAX's shutdown barrier
for processes that will never arrive; every process heartbeats there and watches the others
(`_watch`), so each ends within about `distributed.heartbeat_s` of a peer's failure, death or
silence, with one line naming that process.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import sys
import threading
import time

import jax
import ml_collections
import numpy as np


class StartupError(Exception):
    """The processes of a job could not start together; the message says why."""


# configs/default.py's `distributed` section (configs may not import lab): what a caller gives no value for.
DEFAULTS = dict(coordinator="", num_processes=0, process_id=-1, timeout_s=300, heartbeat_s=30)
# Keys of the job's liveness in the coordination service's key-value store, one per process.
ALIVE, FAILED, DONE, GATHER = "positional/alive/", "positional/failed/", "positional/done/", "positional/gather/"
_GATHERS = itertools.count()  # gather_json's calls, numbered alike on every process
GATHER_WAIT_MS = 3_600_000  # a peer that never comes is the watcher's to report, well before this
RERUN = "Rerun every process of the job (the same command on each): it resumes from the newest checkpoint"


def _cluster_detected() -> bool:
    """Whether JAX recognises a cluster launcher in the environment (its own auto-detection)."""
    try:
        from jax._src.clusters import ClusterEnv
        return any(not env.opt_in_only_method and env.is_env_present() for env in ClusterEnv._cluster_types)
    except (ImportError, AttributeError):  # the private API moved: explicit fields still work
        return False


def check(d: ml_collections.ConfigDict | dict | None) -> ml_collections.ConfigDict:
    """A config's `distributed` section with DEFAULTS filled in; ValueError naming a bad field."""
    d = ml_collections.ConfigDict({**DEFAULTS, **(d or {})})
    if d.num_processes < 0 or (d.num_processes and not -1 <= d.process_id < d.num_processes):
        raise ValueError(f"distributed.process_id={d.process_id} with distributed.num_processes={d.num_processes}; "
                         "valid: 0 <= process_id < num_processes (-1: detected)")
    host, _, port = d.coordinator.rpartition(":")
    if d.coordinator and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"distributed.coordinator={d.coordinator!r}; valid: host:port of process 0, e.g. "
                         "10.0.0.1:1234 (the same on every process)")
    for field in ("timeout_s", "heartbeat_s"):
        if not (isinstance(d[field], (int, float)) and d[field] > 0):
            raise ValueError(f"distributed.{field}={d[field]!r}; valid: a number of seconds > 0")
    return d


def initialize(d: ml_collections.ConfigDict | dict | None) -> None:
    """`jax.distributed.initialize` for a multi-process job, from a run config's `distributed`
    section (configs/default.py; fields left out take DEFAULTS; None: detection only); a no-op for one process, or when done
    already. Must run before anything touches a device. CPU processes talk through gloo."""
    d = check(d)
    if jax.distributed.is_initialized() or not (d.coordinator or d.num_processes > 1 or _cluster_detected()):
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    why = (f"the job's processes did not start together within distributed.timeout_s={d.timeout_s} s (coordinator "
           f"{d.coordinator or 'detected'})")
    advice = "Check that the coordinator's host:port is reachable from every process and that every process was launched"
    # JAX aborts the process when its own deadline passes; this watchdog ends it first, in one line.
    watchdog = threading.Timer(d.timeout_s, lambda: (print(f"error: {why}. {advice}", file=sys.stderr, flush=True),
                                                     os._exit(1)))
    watchdog.daemon = True
    watchdog.start()
    _HEARTBEAT_S[0] = d.heartbeat_s
    try:
        jax.distributed.initialize(coordinator_address=d.coordinator or None, num_processes=d.num_processes or None,
                                   process_id=None if d.process_id < 0 else d.process_id,
                                   initialization_timeout=int(d.timeout_s) + 60)
    except Exception as e:  # noqa: BLE001 - JAX raises several kinds; all mean the job did not start
        raise StartupError(f"{why}: {first_line(e)}. {advice}") from None
    finally:
        watchdog.cancel()
    atexit.register(_mark_done)  # runs before JAX's shutdown (registered earlier)
    watcher = threading.Thread(target=_watch, args=(d.heartbeat_s, d.coordinator or "detected"), daemon=True,
                               name="positional-heartbeat")
    watcher.start()
    atexit.register(_stop_watching, watcher)  # runs first of the three


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def multi() -> bool:
    """Whether this process is one of several in a job."""
    return jax.distributed.is_initialized() and jax.process_count() > 1


def _client():
    from jax._src import distributed as jax_distributed
    return jax_distributed.global_state.client


def _ids(client, folder: str) -> dict[int, str]:
    """{process id: value} of the keys under `folder`."""
    return {int(k.rpartition("/")[2]): v for k, v in client.key_value_dir_get(folder)}


def _mark_done(how: str = "ended") -> None:
    """Tell the watchers that this process ends (its heartbeat stops for that reason)."""
    try:
        _client().key_value_set(f"{DONE}{jax.process_index()}", how, True)
    except Exception:  # noqa: BLE001 - the coordinator is gone already
        pass


_ENDING = threading.Lock()  # the main thread and the watcher: one of them prints the last line
_HEARTBEAT_S = [DEFAULTS["heartbeat_s"]]
_WATCH_STOP = threading.Event()


def _stop_watching(watcher: threading.Thread) -> None:
    """At a normal exit (sys.exit included), end the watcher between its calls before Python
    finalises: a daemon thread still inside a C++ call of JAX's client then is unwound by force,
    which aborts the process ("FATAL: exception not rethrown"; seen at a SIGTERM stop's exit)."""
    _WATCH_STOP.set()
    watcher.join(timeout=10)


def end(line: str, code: int, tell: bool = True) -> None:
    """This process's last word: `line` on stderr, then exit `code`. In a multi-process job the
    others are told first (unless `tell` is False: the line is about a peer that told them
    already), and the exit is immediate (os._exit): JAX's shutdown barrier would wait for
    processes that have failed or will stop."""
    if not multi():
        print(line, file=sys.stderr, flush=True)
        sys.exit(code)
    _ENDING.acquire()
    if code and tell:
        try:
            _client().key_value_set(f"{FAILED}{jax.process_index()}", line.removeprefix("error: "), True)
        except Exception:  # noqa: BLE001 - the coordinator is gone: the others notice that themselves
            pass
    _exit(line, code)


def _stop(why: str) -> None:
    """End this process for another's failure (the watcher's, or the lost coordinator's line),
    unless this process ends within a second with its own line (an error every process meets)."""
    time.sleep(1.0)
    if _ENDING.acquire(blocking=False):
        _exit(f"error: {why}; this process stopped too. {RERUN}", 1)


def _exit(line: str, code: int) -> None:
    """Print `line`, mark this process done and leave at once; process 0, which hosts the
    coordination service, first waits (heartbeat_s at most) until the others have gone or
    fallen silent, since losing the service aborts them."""
    print(f"{line} [process {jax.process_index()}]", file=sys.__stderr__, flush=True)  # from any thread
    sys.stdout.flush()
    _mark_done("failed")
    if jax.process_index() == 0:
        client, interval = _client(), min(1.0, _HEARTBEAT_S[0] / 5)
        deadline, before = time.monotonic() + _HEARTBEAT_S[0], None
        while time.monotonic() < deadline:
            try:
                done, alive = _ids(client, DONE), _ids(client, ALIVE)
            except Exception:  # noqa: BLE001
                break
            if all(p in done or (before is not None and alive.get(p) == before.get(p))
                   for p in range(1, jax.process_count())):
                time.sleep(0.5)  # their own os._exit, after marking
                break
            before = alive
            time.sleep(2 * interval)
    os._exit(code)


def why_failed(e: BaseException, wait_s: float = 3.0) -> tuple[str, bool]:
    """The line for an error seen in a collective (a peer died or stopped), and whether it names
    the peer that failed (which told the job; else the error's first line, after `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if peer := _failed_peer():
            return f"error: process {peer[0]} failed ({peer[1]}); this process stopped too. {RERUN}", True
        time.sleep(0.2)
    return (f"error: a collective with the other processes failed ({type(e).__name__}: {first_line(e)}): another "
            f"process ended or its host was lost (see its own output). {RERUN}"), False


def _failed_peer() -> tuple[int, str] | None:
    try:
        failed = _ids(_client(), FAILED)
    except Exception:  # noqa: BLE001 - the coordinator is gone
        return None
    return next(((p, why) for p, why in sorted(failed.items()) if p != jax.process_index()), None)


def _watch(heartbeat_s: float, coordinator: str) -> None:
    """Heartbeat for this process and watch the others (a daemon thread, for the job's life):
    a peer that failed, stopped heartbeating for `heartbeat_s` without finishing, or a
    coordinator unreachable for `heartbeat_s`, ends this process with one line."""
    client, me, n = _client(), jax.process_index(), jax.process_count()
    interval = min(1.0, heartbeat_s / 5)
    seen = {p: (None, time.monotonic()) for p in range(n) if p != me}  # last heartbeat, when it changed
    beat, unreachable = 0, None
    while not _WATCH_STOP.is_set():
        now = time.monotonic()
        try:
            beat += 1
            client.key_value_set(f"{ALIVE}{me}", str(beat), True)
            alive, done = _ids(client, ALIVE), _ids(client, DONE)
            unreachable = None
        except Exception as e:  # noqa: BLE001 - the coordination service (process 0) is gone
            unreachable = unreachable or now
            if now - unreachable > heartbeat_s:  # (JAX's own client usually aborts the process first)
                _stop(f"lost the job's coordinator, process 0 ({first_line(e)}): it ended or its host is unreachable")
            _WATCH_STOP.wait(interval)
            continue
        if peer := _failed_peer():
            _stop(f"process {peer[0]} failed ({peer[1]})")
        for p, (value, since) in seen.items():
            if alive.get(p) != value:
                seen[p] = (alive.get(p), now)
            elif p not in done and now - since > heartbeat_s:
                _stop(f"process {p} stopped responding: no heartbeat for {heartbeat_s:g} s "
                      "(distributed.heartbeat_s; killed, hung, or its host lost)")
        _WATCH_STOP.wait(interval)


def check_same_config(config: ml_collections.ConfigDict) -> None:
    """Raise ValueError in every process, naming the fields, if the processes were given
    different configs (distributed.process_id aside), or naming the counts if they have
    different numbers of devices."""
    mine = json.loads(config.to_json_best_effort())
    mine.get("distributed", {}).pop("process_id", None)
    gathered = gather_json({"config": mine, "devices": jax.local_device_count()})
    if len(counts := [g["devices"] for g in gathered]) > 1 and len(set(counts)) > 1:
        raise ValueError(f"the processes have different numbers of devices ({', '.join(f'process {p}: {n}' for p, n in enumerate(counts))}); "
                         "every process of a job needs the same number (check XLA_FLAGS, CUDA_VISIBLE_DEVICES or "
                         "each host's accelerators)")
    configs = [g["config"] for g in gathered]
    differ = [f"process {p}: {d}" for p, c in enumerate(configs) if (d := _diff(configs[0], c))]
    if differ:
        raise ValueError(f"the processes were launched with different configs ({'; '.join(differ)}); "
                         "launch every process with the same flags")


def gather_json(obj) -> list:
    """`obj` (anything JSON can hold) from every process, in process order, through the
    coordination service's key-value store (not a device collective: it works before the
    processes' devices are known to match). Every process calls it at the same points."""
    if jax.process_count() == 1:
        return [obj]
    client, key = _client(), f"{GATHER}{next(_GATHERS)}/"
    client.key_value_set(f"{key}{jax.process_index()}", json.dumps(obj))
    return [json.loads(client.blocking_key_value_get(f"{key}{p}", GATHER_WAIT_MS)) for p in range(jax.process_count())]


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
