"""Training: the loss and the jitted, sharded train step, the dry run, and the loop (resume,
checkpoints, signals, the NaN guard, metrics to JSONL and TensorBoard; every train.eval_every
steps the validation loss and the named evaluators of `config.evals`, the ones eval.py runs,
on the live model, with their reports under <workdir>/evals/<step>/<name>/).

One trainer at a time per workdir: `<workdir>/lock` is held for the whole run.

Each step's metrics are read one step late: the host dispatches step s + 1 before it waits for
step s's loss, so it never stalls the device. A checkpoint is written only after the metrics of
its step have been read and found finite.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx
from tensorboardX import SummaryWriter
from tqdm import tqdm

from data import pipeline, tasks
from lab.checkpoints import (checkpoint_manager, complete_steps, identity, identity_change, load_params, newest_meta,
                             restore_latest, save, set_aside, set_aside_partial_saves, stored_identity)
from lab import distributed, files
from lab.evaluators import configured, in_training
from lab.lowering import memory
from lab.lengths import perplexity_at, task_accuracy_at
from lab.runs import Run
from lab.state import (abstract_train_step, check_config, check_windows, init_state, make_loss, make_train_step,
                       mesh_and_batch, workdir_of)


class TrainingError(Exception):
    """A run that cannot go on; the message says why and where the last good state is."""


def dry_run(config: ml_collections.ConfigDict) -> dict:
    """Compile the sharded train step of `config` on abstract inputs, allocating and running
    nothing: the parameter count, the batch it takes ({key: dtype}, the keys this config's loader
    yields) and XLA's memory analysis of the program each device runs."""
    check_config(config)
    check_windows(config)
    vocab = config.model.vocab_size or pipeline.tokenizer(config.data).vocab_size
    step, (state, batch), mesh = abstract_train_step(config, vocab, keys=pipeline.batch_keys(config.data))
    return {"devices": jax.device_count(), "mesh": dict(mesh.shape),
            "params": sum(math.prod(x.shape) for x in jax.tree.leaves(state["params"])),
            "batch": {k: str(x.dtype) for k, x in batch.items()},
            **memory(step.lower(state, batch).compile())}


def dry_run_report(r: dict) -> str:
    mib = lambda b: f"{b / 2 ** 20:,.1f} MiB"  # noqa: E731
    return "\n".join([
        f"dry run: {r['devices']} devices, mesh {r['mesh']}, {r['params']:,} parameters",
        "per device (XLA memory analysis of the compiled train step):",
        f"  arguments {mib(r['argument_bytes'])}, outputs {mib(r['output_bytes'])} "
        f"(aliased to arguments {mib(r['alias_bytes'])}), temporaries {mib(r['temp_bytes'])}",
        f"  total {mib(r['total_bytes'])}; batch {r['batch']}"])


@contextlib.contextmanager
def workdir_lock(workdir: str):
    """Hold `<workdir>/lock` while the block runs, or raise TrainingError naming its holder.

    The lock is an flock, which the OS releases however its holder ends (SIGKILL included);
    the file names the holder (host, pid, start) for the message, and is emptied on release,
    so a holder still named in a free lock died holding it: that lock is taken over with a
    warning. Process 0 takes it for a run of several processes. A workdir in a bucket
    (gs://...) has no lock, which a bucket cannot hold: a warning says so.
    """
    if not files.is_local(workdir):
        print(f"warning: {workdir} is not on a local filesystem and cannot be locked; make sure no other "
              "trainer uses it", file=sys.stderr)
        yield
        return
    path = os.path.join(workdir, "lock")
    with open(path, "a+") as f:  # created if missing, not truncated before it is ours
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise TrainingError(
                f"{workdir} is in use by {f.read().strip() or 'another trainer'} (lock file {path}); "
                "wait for that run to end or stop it, or give this one another --config.workdir") from None
        f.seek(0)
        if dead := f.read().strip():
            print(f"warning: taking over {path} from {dead}, which ended without releasing it",
                  file=sys.stderr)
        f.truncate(0)
        with _writing(path):  # unbuffered: a full disk fails here, not again when the file closes
            os.write(f.fileno(), f"{socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                     .encode())
        try:
            yield
        finally:
            f.truncate(0)


def train(config: ml_collections.ConfigDict) -> dict:
    """Run (or resume) training. Returns a summary dict, its 'interrupted' the name of the
    signal that stopped the run early (None if it ran to the end). Raises ValueError for a bad
    config value and TrainingError on divergence or when another trainer holds the workdir."""
    check_config(config)
    check_windows(config)
    evaluators = configured(config)  # a bad name fails here, before any work
    distributed.initialize(config.get("distributed"))
    distributed.check_same_config(config)
    workdir = workdir_of(config)
    if files.path(workdir).exists() and not files.path(workdir).is_dir():
        raise ValueError(f"workdir={workdir!r} is a file, not a directory; pass a new directory or a run's")
    created = not files.path(workdir).exists()
    files.path(workdir).mkdir(parents=True, exist_ok=True)
    try:
        # One writer: process 0 holds the lock and writes the run's files; every process reads.
        with workdir_lock(workdir) if jax.process_index() == 0 else contextlib.nullcontext():
            return _train(config, workdir, evaluators)
    except _WriteFailed as e:  # before the first step: nothing trained, nothing to save
        raise TrainingError(_write_failure(e, files.join(workdir, "checkpoints"))) from e
    except BaseException:
        if created and jax.process_index() == 0:
            _remove_if_unused(workdir)
        raise


UNUSED = {"lock", "config.json"}  # what a start writes before its first step


def _remove_if_unused(workdir: str) -> None:
    """A workdir this failed start created and that holds nothing of a run (no checkpoint, no
    metrics: only the lock, the config and empty folders) is removed, so a failed start leaves
    nothing behind."""
    if not files.is_local(workdir) or not os.path.isdir(workdir):
        return
    for folder, _, names in os.walk(workdir):
        if any(os.path.normpath(folder) != os.path.normpath(workdir) or name not in UNUSED for name in names):
            return
    shutil.rmtree(workdir, ignore_errors=True)


def _train(config, workdir, evaluators) -> dict:
    manager, aside = _open_checkpoints(config, workdir)
    trainer = _Trainer(config, workdir, evaluators, manager)
    trainer.start(aside)
    return trainer.loop()


def _open_checkpoints(config, workdir):
    """(the run's checkpoint manager, the folder unreadable saves go to), after checking that the
    workdir's checkpoints are this model's training run and setting aside unfinished saves."""
    ckpt_dir, aside = (files.join(workdir, name) for name in ("checkpoints", "checkpoints.unreadable"))
    manager = checkpoint_manager(ckpt_dir, config.train.keep_checkpoints, asynchronous=config.train.async_checkpoints)
    if imported := newest_meta(manager).get("imported_from"):
        raise TrainingError(
            f"{workdir} holds a checkpoint imported from {imported} (parameters only, no optimizer state) and "
            f"is not a training run to resume; train from it in a new workdir: --config.init_from={workdir} "
            "--config.workdir=<new>")
    stored = stored_identity(manager, workdir)
    if stored is not None and (change := identity_change(stored, config)):
        raise TrainingError(
            f"{workdir} holds the checkpoints of a different model ({change}); nothing was changed. Give this "
            f"run another --config.workdir, or start it from that run's parameters with --config.init_from={workdir}")
    if jax.process_index() == 0:
        with _writing(f"{aside} (where unfinished saves are set aside)"):
            set_aside_partial_saves(ckpt_dir, aside)
    distributed.barrier("partial saves set aside")
    return manager, aside


class _Trainer:
    """A run while it trains, in named steps: `start` (restore, initialise from another run, or
    initialise), `loop` (signals and the run's outputs around `steps`), `steps` (one train step
    after another), `read` (a step's metrics: the guard, then `log`), `checkpoint` (the guard on
    the parameters a checkpoint keeps, then save)."""

    def __init__(self, config, workdir, evaluators, manager):
        self.config, self.workdir, self.evaluators, self.manager = config, workdir, evaluators, manager
        self.primary, self.multi = jax.process_index() == 0, jax.process_count() > 1
        self.mesh, self.batch_sharding = mesh_and_batch(config)  # before data: a mesh that does not fit fails at once
        self.vocab = pipeline.tokenizer(config.data).vocab_size
        # The state's shapes first: a resumed run reads its checkpoint into them, one started from
        # init_from its parameters; only a fresh run initialises (so memory holds one state, not two).
        self.graphdef, self.rest, self.tx, self.schedule, self.abstract = init_state(
            config, self.vocab, self.mesh, abstract=True)
        self.train_step = make_train_step(self.graphdef, self.rest, self.tx, config, self.shardings(),
                                          self.batch_sharding)
        self.loss_after = jax.jit(make_loss(self.graphdef, self.rest, config))  # of the parameters a checkpoint keeps
        self.loader = self.streams()
        self.metrics_path = files.join(workdir, "metrics.jsonl")
        self.history = []  # every step's loss
        self.probe, self.lowest = None, None  # the batch checkpoints are judged on (IN_LINE); its lowest loss

    def shardings(self):
        return jax.tree.map(lambda x: x.sharding, self.abstract)

    def streams(self):
        """The run's batches from its first, this process's rows of them."""
        config = self.config
        return pipeline.Streams(config.data, seed=config.seed, batch_size=config.batch_size,
                                seq_len=config.seq_len + 1, streams=config.data.streams,
                                rows=distributed.local_rows(self.batch_sharding, config.batch_size))

    def probe_of(self) -> dict:
        """What the run's first batch depends on beyond the model's identity."""
        return {k: self.config[k] for k in ("seed", "batch_size", "seq_len")}

    def batch(self, loader) -> dict:
        """The loader's next batch as global arrays."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
                for k, v in next(loader).items()}

    def start(self, aside: str) -> None:
        """The state to train from (self.state, self.step0) and the run's files for this start."""
        config, workdir = self.config, self.workdir
        found = restore_latest(self.manager, self.abstract, aside=aside if self.primary else None)
        distributed.barrier("restored")
        if found is not None:
            self.step0, restored = found
            self.state = restored["state"]
            self.loader.set_state(restored["loader"])
            # The lowest loss of the fixed batch carries over where the batch is the same one.
            stored = dict(restored["meta"].get("probe") or {})
            lowest = stored.pop("lowest", None)
            self.lowest = lowest if stored == self.probe_of() else None
            if self.step0 >= config.train.steps:
                print(f"already finished: step {self.step0} of {config.train.steps} in {workdir}; its losses are "
                      f"in {self.metrics_path} (raise --config.train.steps to train on)")
            else:
                print(f"resumed from step {self.step0} in {workdir}")
        elif config.init_from:
            self.step0, self.state = 0, self.init_from()
        else:
            self.step0, self.state = 0, init_state(config, self.vocab, self.mesh)[4]
        self.saves = _Saves(self.manager)
        if self.primary:
            with _writing(self.metrics_path):
                cut_metrics(self.metrics_path, self.step0)
            with _writing(files.join(workdir, "config.json")):
                files.write_text(files.join(workdir, "config.json"), config.to_json_best_effort(indent=2))

    def init_from(self) -> dict:
        """The train state of config.init_from's parameters, its optimizer state built sharded."""
        config, shardings = self.config, self.shardings()
        src_step, params = load_params(config.init_from, self.abstract["params"])
        # The optimizer state of fresh (fp32) parameters, built sharded; the step placed likewise.
        opt_state = jax.jit(lambda p: self.tx.init(jax.tree.map(lambda x: x.astype(jnp.float32), p)),
                            out_shardings=shardings["opt_state"])(params)
        state = {"params": params, "opt_state": opt_state,
                 "step": jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])}
        print(f"initialised parameters from {config.init_from} (step {src_step})")
        if config.train.steps == 0:  # zero-shot: the loaded parameters under this run's config
            save(self.manager, state, loader_state(self.loader),
                 {"step": 0, "loss": float("nan"), "identity": identity(config)})
        return state

    def loop(self) -> dict:
        """Train from step0 to train.steps or a signal; the summary `train` returns."""
        # A signal stops the run at the next step boundary with a checkpoint. Several processes
        # agree on that step through JAX's preemption sync, which hears SIGTERM: SIGINT is relayed to it.
        self.stop = stop = _Stop(relay=self.multi)
        previous = {s: signal.signal(s, stop)
                    for s in ((signal.SIGINT,) if self.multi else (signal.SIGTERM, signal.SIGINT))}
        self.writer = SummaryWriter(files.join(self.workdir, "tensorboard")) if self.primary else None
        self.progress = _progress(self.step0, self.config.train.steps, files.path(self.workdir).name)
        self.t_log, self.n_log = time.perf_counter(), 0  # the time of the last log line; steps since
        background = _BackgroundOutput(files.join(self.workdir, "errors.log"))  # after tqdm took the terminal
        ended = False
        try:
            self.steps()
            self.saves.confirm()  # the last asynchronous save
            ended = True
        except _WriteFailed as e:
            raise TrainingError(_write_failure(e, self.manager.directory, self.state, self.loader)
                                + background.where()) from e
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self.progress.close()
            # After a failure, closing (which flushes to the same full disk) must not hide its line,
            # and what it reports goes to the log.
            background.everything = not ended
            with contextlib.suppress(Exception) if not ended else contextlib.nullcontext():
                if self.writer:
                    self.writer.close()
                self.manager.close()
            background.close(keep_filter=not ended)
        step = int(self.state["step"])
        return {"workdir": self.workdir, "step": step, "losses": self.history,
                "interrupted": stop.signal if step < self.config.train.steps else None}

    def steps(self) -> None:
        """One train step after another. Each step's metrics are read when the next one has been
        dispatched, or at once where a checkpoint or validation needs the step's state."""
        config, stop = self.config, self.stop
        pending = None  # (step, metrics) of the step dispatched last, metrics not read yet
        for step in range(self.step0 + 1, config.train.steps + 1):
            batch = self.batch(self.loader)
            self.state, metrics = self.train_step(self.state, batch)  # donates the previous state
            if pending is not None:
                self.read(*pending)
            pending = (step, metrics)
            if self.multi and self.manager.reached_preemption(step):
                stop.signal = stop.heard or "SIGTERM"
            checkpoint = step % config.train.checkpoint_every == 0 or step == config.train.steps or stop.signal
            validate = config.train.eval_every and step % config.train.eval_every == 0
            if checkpoint or validate:  # both need this step's state, so wait for it now
                self.read(step, metrics, self.state["params"] if validate else None)
                pending = None
            if checkpoint:
                self.checkpoint(step, batch)
            if stop.signal:
                break

    def read(self, step: int, metrics: dict, params=None) -> None:
        """Read step `step`'s metrics (the host waits here, for this step only), guard, log;
        `params` after the step are given where validation is due."""
        loss = float(metrics["loss"])
        what = blow_up(loss, bool(metrics["params_finite"]), self.history, self.config.train.explode_factor)
        if what:
            raise TrainingError(f"{what} at step {step}. " + _diverged(self.saves, self.workdir, self.primary))
        self.history.append(loss)
        self.n_log += 1
        self.progress(step, loss)
        if step % self.config.train.log_every == 0 or step == self.config.train.steps or params is not None:
            self.log(step, loss, metrics, params)

    def log(self, step: int, loss: float, metrics: dict, params=None) -> None:
        """One line of metrics.jsonl and TensorBoard: the step's, and with `params` the validation
        loss and the evaluators' results on them."""
        config = self.config
        elapsed = time.perf_counter() - self.t_log
        record = {"step": step, "loss": loss, "grad_norm": float(metrics["grad_norm"]),
                  "lr": float(self.schedule(step - 1)),
                  "tokens_per_s": self.n_log * config.batch_size * config.seq_len / elapsed, "time": time.time()}
        if params is not None:
            model = nnx.merge(self.graphdef, params, self.rest)
            record.update(_validation(config, model))
            # Every process evaluates (the parameters may be sharded over all of them); one writes.
            record.update(in_training(self.evaluators, Run(self.workdir, config, model, step),
                                      files.join(self.workdir, "evals", str(step)), write=self.primary))
        if self.primary:
            with _writing(self.metrics_path):
                files.append_lines(self.metrics_path, [json.dumps(record) + "\n"])
            with _writing(f"the TensorBoard events in {files.join(self.workdir, 'tensorboard')}"):
                _tensorboard(self.writer, record)
            self.progress.tokens_per_s = record["tokens_per_s"]
            self.progress.log(record)
        self.t_log, self.n_log = time.perf_counter(), 0

    def checkpoint(self, step: int, batch: dict) -> None:
        """Save step `step`'s state, unless its parameters diverged (TrainingError) or keeping an
        out-of-line state would push the last good checkpoint out of train.keep_checkpoints."""
        config = self.config
        # The step's loss is that of the parameters before its update; those the
        # checkpoint keeps are after it, so they are scored too (on the same batch).
        rng = jax.random.fold_in(jax.random.key(config.seed), step)
        after = float(self.loss_after(self.state["params"], batch, rng))
        what = blow_up(after, True, self.history, config.train.explode_factor)
        if what:
            raise TrainingError(f"{what} with the parameters of step {step} (on its batch). "
                                + _diverged(self.saves, self.workdir, self.primary))
        if self.probe is None:  # the run's first batch, whatever step this start resumed from
            self.probe = self.batch(self.streams())
        probe = float(self.loss_after(self.state["params"], self.probe, jax.random.key(config.seed)))
        self.lowest = probe if self.lowest is None else min(self.lowest, probe)
        good = in_line(probe, self.lowest, config.train.explode_factor)
        self.saves.confirm()
        last_good = self.saves.good
        newer = [s for s in self.manager.all_steps() if last_good is None or s > last_good]
        # An out-of-line state is kept unless it would push the newest good one out of
        # train.keep_checkpoints. A stop or the last step is always kept: it makes room by deleting
        # the out-of-line checkpoints after the good one (the rotation's next to go), not that one.
        keep = config.train.keep_checkpoints
        why = (f"its parameters' loss on the fixed batch, {probe:.4g}, is over {IN_LINE:g} x the lowest at a "
               f"checkpoint so far, {self.lowest:.4g}")
        evicts = bool(keep) and len(newer) + 1 >= keep
        if good or self.stop.signal or step == config.train.steps or last_good is None or not evicts:
            if not good:
                if evicts and last_good is not None and keep > 1:
                    for s in newer:
                        self.manager.delete(s)
                kept = ("no saved checkpoint is in line with the run yet" if last_good is None else
                        f"step {last_good} stays the last good checkpoint" if not evicts or keep > 1 else
                        f"it replaces step {last_good}, the last good checkpoint (train.keep_checkpoints=1)")
                print(f"warning: step {step} is out of line with the run ({why}); saved, but {kept}", file=sys.stderr)
            meta = {"step": step, "loss": self.history[-1], "identity": identity(config),
                    "probe": {**self.probe_of(), "lowest": self.lowest}}
            self.saves.save(self.state, self.loader, meta, good)
        else:
            print(f"warning: step {step} not saved: it is out of line with the run ({why}), and keeping it "
                  f"would delete step {last_good}, the last good checkpoint (train.keep_checkpoints={keep})",
                  file=sys.stderr)


class _WriteFailed(Exception):
    """Writing the file named in the message failed; the cause says why."""


@contextlib.contextmanager
def _writing(what: str):
    """A failure in the block is a failed write of `what` (_WriteFailed; orbax reports a full
    disk as a ValueError), except a collective's failure in a job of several processes: a peer
    died during the save, which `lab.cli.run_cli` names."""
    try:
        yield
    except Exception as e:
        if distributed.multi() and isinstance(e, jax.errors.JaxRuntimeError):
            raise
        raise _WriteFailed(what) from e


class _BackgroundOutput:
    """While training runs, orbax's and asyncio's logs and what threads other than the main one
    print (orbax's and tensorstore's writers: a failed save prints dozens of tracebacks) go to
    the file `path` instead of the terminal (to a temporary file where that cannot be written:
    a full disk)."""

    def __init__(self, path: str):
        self.path, self.written, self.stream = path, None, sys.stderr
        self.handler = logging.get_absl_handler()
        sys.stderr = self
        self.handler.addFilter(self.filter)

    everything = False  # every thread's output to the file (closing a run that failed)

    def _main(self) -> bool:
        return threading.current_thread() is threading.main_thread() and not self.everything

    def write(self, text: str) -> int:
        if self._main():
            return self.stream.write(text)
        self._keep(text)
        return len(text)

    def filter(self, record) -> bool:
        if self._main() and record.name != "asyncio" and f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        self._keep(self.handler.format(record) + "\n")
        return False

    def _files(self):
        """Where the output goes, in order of preference: the file written so far, the run's, a
        temporary one (a full disk)."""
        return filter(None, (self.written, self.path, os.path.join(tempfile.gettempdir(), f"errors-{os.getpid()}.log")))

    def _keep(self, text: str) -> None:
        for path in self._files():
            try:
                files.append_lines(path, [text])
                self.written = path
                return
            except OSError:
                continue

    def where(self) -> str:
        return f" (the writers' own messages: {self.written})" if self.written else ""

    def close(self, keep_filter: bool = False) -> None:
        """Back to the terminal; with `keep_filter` (after a failure) the logs of the writers'
        futures, which Python reports when it frees them at exit, still go to the file, and so
        do the warnings Python gives as it exits (a write cut off leaves a coroutine never
        awaited: once, after the error line, it was the terminal's last line)."""
        sys.stderr, self.everything = self.stream, False
        if not keep_filter:
            self.handler.removeFilter(self.filter)
            return
        atexit.register(self._exit_to_file)

    def _exit_to_file(self) -> None:
        """As Python exits (after the error line), file descriptor 2 to the file: Python puts its
        own stderr back before it frees what is left, so only the descriptor catches that."""
        sys.stderr.flush()
        for path in self._files():
            try:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError:
                continue
            os.dup2(fd, 2)
            os.close(fd)
            return

    def __getattr__(self, name):
        return getattr(self.stream, name)


class _Saves:
    """The run's checkpoints as they are saved. An asynchronous save is confirmed complete
    before the next one starts (or at the end), so a failed write names its own step; `good` is
    the newest confirmed checkpoint in line with the run (`in_line`)."""

    def __init__(self, manager):
        self.manager, self.good, self.pending = manager, manager.latest_step(), None

    def save(self, state, loader, meta: dict, good: bool) -> None:
        self.confirm()
        with _writing(f"checkpoint {meta['step']} in {self.manager.directory}"):
            save(self.manager, state, loader_state(loader), meta)
        self.pending = (meta["step"], good)

    def confirm(self) -> None:
        """Wait for the save in flight; _WriteFailed naming it if it failed."""
        if self.pending is not None:
            step, good = self.pending
            self.pending = None
            with _writing(f"checkpoint {step} in {self.manager.directory}"):
                self.manager.wait_until_finished()
            self.good = step if good else self.good



def _write_failure(e: _WriteFailed, checkpoints: str, state=None, loader=None) -> str:
    """The one line for a failed write: what failed and why, the newest complete checkpoint in
    the directory `checkpoints` (a rerun resumes from it), and, given the live `state`, an
    emergency save of it into a fresh temporary directory (not the run's checkpoints: the NaN
    guard has not seen this state)."""
    cause = e.__cause__
    why = f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:300]}"
    # The operating system's reason, which a long message (orbax's paths) would cut off.
    code = getattr(cause, "errno", None) or next(map(int, re.findall(r"os_error_code='(\d+)'", str(cause))), None)
    if code and os.strerror(code) not in why:
        why += f"; {os.strerror(code)}"
    newest = max(complete_steps(checkpoints), default=None)
    resume = (f"the newest complete checkpoint is step {newest} in {checkpoints} (a rerun resumes from it)"
              if newest is not None else "no checkpoint is complete (a rerun starts from step 0)")
    line = f"cannot write {e} ({why}). Free space or fix permissions; {resume}"
    if state is None:
        return f"{line}; nothing was trained since"
    step = int(state["step"])
    if jax.process_count() > 1:  # the state is spread over the processes: no one place to save it
        return f"{line}; steps after it are lost"
    try:
        where = tempfile.mkdtemp(prefix=f"emergency-checkpoint-{step}-")
        emergency = checkpoint_manager(where, keep=1)
        save(emergency, state, loader_state(loader), {"step": step, "loss": float("nan"), "emergency": True})
        emergency.close()
        return (f"{line}; the state of step {step} was saved to {where}/{step} (not checked by the NaN guard): "
                f"move it into {checkpoints} to continue from it")
    except Exception as e2:  # noqa: BLE001 - nowhere to write: the last checkpoint is what is left
        return f"{line}; no emergency save of step {step} was possible either ({type(e2).__name__}: {str(e2)[:100]})"


def loader_state(loader) -> dict:
    """The state of every stream of the batch, gathered from the processes that load them."""
    return {k: v for states in distributed.gather_json(loader.get_state()) for k, v in states.items()}


def cut_metrics(path: str, step: int) -> None:
    """Move the lines of a metrics file past `step` (from a run that stopped after its last
    checkpoint, which the resumed run logs again) or unreadable (cut off mid-write) to
    <name>.dropped.jsonl beside it, so each step is logged once; nothing is deleted."""
    if not files.path(path).is_file():
        return
    lines = files.read_text(path).splitlines(keepends=True)

    def kept(line):
        try:
            return json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):
            return False

    keep = [line for line in lines if kept(line)]
    if len(keep) == len(lines):
        return
    dropped = path.removesuffix(".jsonl") + ".dropped.jsonl"
    files.append_lines(dropped, [line if line.endswith("\n") else line + "\n" for line in lines if not kept(line)])
    files.replace_text(path, "".join(keep))
    print(f"note: {len(lines) - len(keep)} lines of {path} after step {step}, where this run resumes, moved "
          f"to {dropped}", file=sys.stderr)


def _diverged(saves: _Saves, workdir: str, primary: bool) -> str:
    """The advice after a divergence: the checkpoints saved after the last good one are moved to
    <workdir>/checkpoints.diverged (nothing deleted), so that a rerun resumes from that one."""
    manager = saves.manager
    try:
        saves.confirm()
    except _WriteFailed:  # a failed last save: it is not among the checkpoints either
        pass
    last_good = saves.good
    later = sorted(s for s in manager.all_steps() if last_good is None or s > last_good)
    aside = files.join(workdir, "checkpoints.diverged")
    if primary:
        for s in later:
            set_aside(files.join(manager.directory, str(s)), aside)
    moved = (f"The checkpoints after it (step{'s' if len(later) > 1 else ''} {', '.join(map(str, later))}) were "
             f"out of line with the run and are moved to {aside}. " if later else "")
    if last_good is None:
        return (f"No checkpoint in line with the run was saved. {moved}Lower train.lr or raise "
                "train.warmup_steps and rerun (it starts again from step 0).")
    return (f"Last good checkpoint: step {last_good} in {manager.directory}. {moved}Lower train.lr or raise "
            "train.warmup_steps and rerun (it resumes from that checkpoint).")


EXPLODE_WINDOW = 50  # losses the explosion check takes the median of
# A checkpoint is good (in line with the run) when its parameters' loss on a fixed batch (the
# run's first) is at most IN_LINE times the lowest at a checkpoint so far (kept in the
# checkpoints, so a resumed run goes on from it): a run that diverges slowly, below the explosion
# threshold, keeps naming the checkpoint from before its loss rose, and a stretch of easier or
# harder documents in the stream moves nothing.
IN_LINE = 1.5


def in_line(loss: float, best: float | None, factor: float) -> bool:
    """Whether a checkpoint's loss is in line with the run (`best`: the lowest of its checkpoints;
    None, or the guard off with explode_factor 0: every finite loss is)."""
    return best is None or not factor or loss <= IN_LINE * best


def blow_up(loss: float, params_finite: bool, history: list, factor: float) -> str | None:
    """Why a step's state must not be kept (None: it may): a non-finite loss or parameter, or a
    loss above `factor` times the median of the last EXPLODE_WINDOW (factor 0: not checked)."""
    if not math.isfinite(loss):
        return f"loss became {loss}"
    if not params_finite:
        return "parameters became nan/inf"
    if factor and history:
        median = statistics.median(history[-EXPLODE_WINDOW:])
        if loss > factor * median:
            return (f"loss exploded to {loss:.6g}, more than train.explode_factor={factor:g} x the median "
                    f"{median:.6g} of the last {min(len(history), EXPLODE_WINDOW)} steps")
    return None


class _Stop:
    """Set by SIGTERM/SIGINT; the loop saves a checkpoint at the next step boundary and exits.
    With `relay` (several processes) a signal is passed on as SIGTERM to JAX's preemption sync,
    which picks the step every process stops at; `heard` keeps its name."""

    def __init__(self, relay: bool = False):
        self.signal = self.heard = None
        self.relay = relay

    def __call__(self, signum, frame):
        if self.relay:
            self.heard = signal.Signals(signum).name
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.signal = signal.Signals(signum).name


def _validation(config, model) -> dict:
    """{'val_loss'} at the training length, or for a synthetic task {'val_loss', 'val_acc'} on
    its answers (eval.task_examples validation examples; 0: all of them)."""
    if tasks.is_task(config.data):
        r = task_accuracy_at(config, model, "validation", config.eval.get("task_examples", 0))
        return {"val_loss": r["nll"], "val_acc": r["accuracy"]}
    return {"val_loss": math.log(perplexity_at(config, model, config.seq_len, config.train.eval_tokens))}


def _tensorboard(writer, record):
    for k, v in record.items():
        if k not in ("step", "time"):
            writer.add_scalar(k, v, record["step"])
    writer.flush()


def _progress(start, total, name: str):
    """A progress bar with loss and tokens/s on stderr (tqdm), or, when not a tty, one line per
    logged step: the run's name, loss, tokens/s and the time left (both from the steps after the
    first logged one, which pays for compiling)."""
    bar = tqdm(total=total, initial=start, disable=not sys.stderr.isatty(), unit="step", desc=name,
               dynamic_ncols=True)
    first = {}  # step and time of the first logged step

    def update(step, loss):
        bar.update(step - bar.n)
        shown = {"tok_s": f"{update.tokens_per_s:,.0f}"} if update.tokens_per_s else {}
        bar.set_postfix(loss=f"{loss:.4f}", **shown, refresh=False)

    def log_line(record):  # without a terminal, one line per logged step instead
        if not bar.disable:
            return
        step, now = record["step"], time.perf_counter()
        rate = ""
        if first and step > first["step"]:
            per_step = (now - first["time"]) / (step - first["step"])
            rate = f"  {record['tokens_per_s']:,.0f} tok/s  ETA {_clock(per_step * (total - step))}"
        first.setdefault("step", step)
        first.setdefault("time", now)
        print(f"{name} step {step}/{total}  loss {record['loss']:.4f}{rate}", flush=True)

    update.tokens_per_s = 0.0
    update.close = bar.close
    update.log = log_line
    return update


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
