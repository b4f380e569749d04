"""Checkpoint I/O of training runs (orbax): save, restore the newest complete checkpoint, and
read a run's parameters for evaluation or `init_from`."""

from __future__ import annotations

import os
import sys

import orbax.checkpoint as ocp


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
