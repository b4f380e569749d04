"""Checkpoint I/O of training runs (orbax): save, restore the newest complete checkpoint
(setting unreadable ones aside), read a run's parameters for evaluation or `init_from`, and a
run's identity, the config fields that shaped its checkpoints."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp

from lab import files

PARTIAL = ".orbax-checkpoint-tmp"  # in the name of a save orbax did not finish
# What a run's checkpoints are of: the model and its data. Changing one of these fields on a
# workdir's rerun would resume a different model, so it is refused (`check_identity`). Not:
# how attention is computed or tiled, the compute dtype, rematerialisation, where data caches, or
# where a pretrained tokenizer's files are (a run directory moved elsewhere keeps its identity).
IDENTITY = ("model.", "data.", "train.param_dtype")
NOT_IDENTITY = ("model.attention_impl", "model.block_size", "model.dtype", "model.remat", "data.data_dir",
                "data.tokenizer_path")


def checkpoint_manager(directory: str, keep: int = 2, create: bool = True,
                       asynchronous: bool = False) -> ocp.CheckpointManager:
    """Orbax's manager of a checkpoint directory. A save is written into a temporary folder and
    renamed into place once complete, so a crash can only lose the save in progress; an
    `asynchronous` save copies the state to host memory, then writes while training goes on."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create,
                                           enable_async_checkpointing=asynchronous)
    return ocp.CheckpointManager(os.path.abspath(directory) if files.is_local(directory) else directory,
                                 options=options)


def save(manager, state, loader_state: dict, meta: dict) -> None:
    """Save `state` at its step, with the loader's state and `meta` (plus the arrays' checksums)."""
    step = int(state["step"])
    meta = {**meta, "checksums": checksums(state)}
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), loader=ocp.args.JsonSave(loader_state),
        meta=ocp.args.JsonSave(meta)), force=True)


@jax.jit
def _bit_sum(x):
    """The bits of `x` as unsigned integers, summed mod 2^32: exact whatever the order or sharding."""
    bits = jax.lax.bitcast_convert_type(x, {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize])
    return jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32)


CHECKSUM_BYTES = 16 * 2 ** 20  # an array is summed in slices of about this many bytes


def checksums(tree) -> dict:
    """{array path: [its dtype, the sum of its bits]}, which orbax does not keep: a restore
    compares them, so a flipped bit in a checkpoint's array data is found instead of read as a
    wrong value. Each array is summed in slices along its first axis (the sum mod 2^32 does not
    depend on how it is split): XLA on a CPU widens the whole array before summing it, which
    for every array at once would double the memory of a model being loaded."""
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        rows = max(1, x.shape[0] * CHECKSUM_BYTES // max(x.nbytes, 1)) if x.ndim else 1
        parts = [x] if not x.ndim or rows >= x.shape[0] else [x[i:i + rows] for i in range(0, x.shape[0], rows)]
        out[jax.tree_util.keystr(path)] = [str(x.dtype), sum(int(_bit_sum(p)) for p in parts) % 2 ** 32]
    return out


def _verify(restored_state, meta: dict | None) -> None:
    """Raise if an array restored in the dtype it was saved in has other bits than it had."""
    expected = (meta or {}).get("checksums")
    if expected is None:  # saved before checksums were kept
        return
    found = checksums(restored_state)
    bad = [k for k, v in found.items() if k in expected and expected[k][0] == v[0] and expected[k] != v]
    if bad:
        raise ValueError(f"checksums differ in {len(bad)} of {len(found)} arrays (first: {bad[0]}): the data "
                         "changed after it was written")


RESTORE_GROUP_BYTES = 256 * 2 ** 20  # a partial restore reads this many bytes of arrays at a time


def leaf_groups(tree: dict, most_bytes: int) -> list[dict]:
    """A nested dict's leaves (arrays or ShapeDtypeStructs), the largest first, in groups of at
    most `most_bytes` (a larger leaf alone), each group as a nested dict holding only its leaves.
    Largest first: a read holds its group twice for a while (the reader's buffer and the array),
    and the largest group so comes while little else is held, the last ones are small."""
    groups, size = [{}], 0
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    for path, leaf in sorted(leaves, key=lambda pl: -pl[1].size * jnp.dtype(pl[1].dtype).itemsize):  # stable
        nbytes = leaf.size * jnp.dtype(leaf.dtype).itemsize
        if size and size + nbytes > most_bytes:
            groups, size = groups + [{}], 0
        node = groups[-1]
        for key in path[:-1]:
            node = node.setdefault(key.key, {})
        node[path[-1].key] = leaf
        size += nbytes
    return groups


def merged(a: dict, b: dict) -> dict:
    """Nested dicts with disjoint leaves as one."""
    return {**a, **{k: merged(a[k], v) if k in a and isinstance(v, dict) else v for k, v in b.items()}}


def _glibc(call: str, *args) -> None:
    """libc's `call`(*args) where the C library is glibc; nothing elsewhere."""
    try:
        getattr(ctypes.CDLL("libc.so.6"), call)(*args)
    except (OSError, AttributeError):
        pass


def release_freed_memory() -> None:
    """Give the memory the checkpoint reader's threads freed back to the OS (glibc keeps it in
    per-thread arenas, which evaluation then adds to: benchmarks/RESULTS.md, section 'Host memory
    of loading and evaluating a 1.24B-parameter import')."""
    _glibc("malloc_trim", 0)


LARGE_BLOCK = 2 ** 20  # bytes: blocks this large or larger are mapped on their own


def unmap_large_blocks_when_freed() -> None:
    """From now on glibc maps every block of LARGE_BLOCK bytes or more on its own and hands it
    back to the OS when freed. By default its threshold climbs to 32 MiB as large blocks are
    freed, and from then on the buffers XLA:CPU allocates while a model is evaluated stay in its
    heap, fragmented (measured: benchmarks/RESULTS.md, section 'Host memory of loading and
    evaluating a 1.24B-parameter import'). eval.py and analyze.py set it at their start; it
    stays out of library calls, so a process that only imports the library keeps glibc's default."""
    _glibc("mallopt", -3, LARGE_BLOCK)  # M_MMAP_THRESHOLD


def _paths(tree) -> set:
    """The leaves' paths of a pytree, as 'params/blocks/0/attn/q/kernel' strings."""
    def name(k):
        return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
    return {"/".join(map(name, path)) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


def layout_change(step_dir: str, abstract_state) -> str | None:
    """How the arrays a checkpoint holds (its metadata, nothing read) differ in name from those
    `abstract_state` asks for (a model whose parameters were renamed since the save): one line,
    or None where every name asked for is there."""
    try:
        stored = _paths(ocp.PyTreeCheckpointHandler().metadata(files.path(files.join(step_dir, "state"))).tree)
    except Exception:  # noqa: BLE001 - no metadata to compare: the restore itself will say what is wrong
        return None
    wanted = _paths(abstract_state)
    missing = sorted(wanted - stored)
    if not missing:
        return None
    heads = {p.split("/")[0] for p in wanted}
    extra = sorted(p for p in stored - wanted if p.split("/")[0] in heads)
    return (f"{len(missing)} array(s) the model has are not in the checkpoint (first: {missing[0]})"
            + (f", which holds {len(extra)} the model lacks (first: {extra[0]})" if extra else "")
            + "; the code's parameter names differ from those the run was saved with: load it with the commit "
              "that trained it (its config.json and metrics say when), or rename the arrays")


def restore_latest(manager, abstract_state, partial: bool = False, aside: str | None = None):
    """Restore the newest checkpoint that reads back completely, or None if there is none.

    Returns (step, {'state', 'loader', 'meta'}). With `partial`, only the subtree given in
    `abstract_state` is read (e.g. {'params': ...}) and only 'state' is returned; it is read in
    groups of arrays of about RESTORE_GROUP_BYTES, each verified and the memory its reading freed
    handed back before the next, so the reader's buffers are one group's. A checkpoint that fails
    to restore (partially written, corrupted) is skipped with a warning and the one before it is
    used; with `aside` (a directory), it is also moved there, out of the way of the run that
    resumes and saves that step again. A checkpoint whose arrays are named otherwise than
    `abstract_state`'s (`layout_change`) is not damaged: that raises, one line, and moves nothing.
    """
    whole = {"state": ocp.args.StandardRestore(abstract_state), "loader": ocp.args.JsonRestore(),
             "meta": ocp.args.JsonRestore()}
    groups = [ocp.args.PyTreeRestore(item=group, partial_restore=True,
                                     restore_args=ocp.checkpoint_utils.construct_restore_args(group))
              for group in (leaf_groups(abstract_state, RESTORE_GROUP_BYTES) if partial else ())]
    try:
        for step in sorted(manager.all_steps(), reverse=True):
            change = layout_change(files.join(manager.directory, str(step)), abstract_state)
            if change:
                raise ValueError(f"{manager.directory} step {step}: {change}")
            try:
                if not partial:
                    restored = manager.restore(step, args=ocp.args.Composite(**whole))
                    _verify(restored["state"], restored["meta"])
                    return step, restored
                meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
                state = {}
                for group in groups:
                    part = manager.restore(step, args=ocp.args.Composite(state=group))["state"]
                    _verify(part, meta)
                    state = merged(state, part)
                    release_freed_memory()
                return step, {"state": state}
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped, loudly
                reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
                where = f"; moved to {set_aside(files.join(manager.directory, str(step)), aside)}" if aside else ""
                print(f"warning: skipping unreadable checkpoint at step {step} in {manager.directory}{where}: "
                      f"{reason}", file=sys.stderr)
        return None
    finally:
        if aside:
            manager.reload()  # forget what was moved


def complete_steps(directory: str) -> list[int]:
    """The steps of the checkpoints in `directory` that a save finished (orbax renames a save
    into place once it is complete), without asking orbax (whose own list may hold a save
    whose asynchronous writing failed)."""
    d = files.path(directory)
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def set_aside(path: str, aside: str) -> str:
    """Move `path` into the directory `aside` (made if missing) under a name not taken yet;
    returns the new path. Nothing is deleted. (In a bucket, a folder is moved by the storage
    backend's rename: object by object.)"""
    files.path(aside).mkdir(parents=True, exist_ok=True)
    target = files.join(aside, f"{files.path(path).name}-{time.strftime('%Y%m%d-%H%M%S')}")
    while files.path(target).exists():
        target += "+"
    if files.is_local(path):
        shutil.move(str(path), target)
    else:
        files.path(path).rename(target)
    return target


def set_aside_partial_saves(directory: str, aside: str) -> list[str]:
    """Move the unfinished saves a killed run left in a checkpoint `directory` aside, each
    reported in one warning line; returns their new paths."""
    moved = []
    for name in sorted(p.name for p in files.path(directory).iterdir()) if files.path(directory).is_dir() else []:
        if PARTIAL in name:
            moved.append(set_aside(files.join(directory, name), aside))
            print(f"warning: {files.join(directory, name)} is a save a stopped run did not finish; "
                  f"moved to {moved[-1]}", file=sys.stderr)
    return moved


def load_params(directory: str, abstract_params):
    """(step, parameters) of the latest complete checkpoint of a run (for eval and init_from).

    `directory` is a run's workdir or its `checkpoints` folder.
    """
    ckpt_dir = files.join(directory, "checkpoints")
    ckpt_dir = ckpt_dir if files.path(ckpt_dir).is_dir() else directory
    if not files.path(ckpt_dir).is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    found = restore_latest(checkpoint_manager(ckpt_dir, create=False), {"params": abstract_params},
                           partial=True)
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint in {ckpt_dir!r}")
    step, restored = found
    return step, restored["state"]["params"]


def identity(config: ml_collections.ConfigDict) -> dict:
    """The IDENTITY fields of a config, flat {'model.d_model': 64, ...}, JSON values."""
    flat = {}

    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, (dict, ml_collections.ConfigDict)):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(json.loads(config.to_json_best_effort()), "")
    return {k: v for k, v in sorted(flat.items())
            if k.startswith(IDENTITY) and not k.startswith(NOT_IDENTITY)}


def newest_meta(manager) -> dict:
    """The meta of the newest checkpoint whose meta reads back ({} when none does)."""
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception:  # noqa: BLE001 - an unreadable checkpoint is restore_latest's to report
            continue
    return {}


def stored_identity(manager, workdir: str) -> dict | None:
    """The identity of the run whose checkpoints `manager` holds: from the newest checkpoint
    whose metadata reads back, else (checkpoints written before identities were stored) from
    the workdir's config.json; None when there are no checkpoints."""
    meta = newest_meta(manager)
    if "identity" in meta:
        return meta["identity"]
    path = files.join(workdir, "config.json")
    if manager.all_steps() and files.path(path).is_file():
        return identity(ml_collections.ConfigDict(json.loads(files.read_text(path))))
    return None


# Option dicts whose entries are given only when set.
OPEN = ("model.scheme_options.", "model.mixer_options.", "model.layer_kinds.", "data.task.")


def identity_change(stored: dict, config: ml_collections.ConfigDict) -> str | None:
    """'model.d_model 64 -> 96, ...' for the identity fields `config` changes, None if none. A
    field the stored identity lacks counts only under the OPEN option dicts: elsewhere it is one
    added to the code since the run began, whose default the run had."""
    new = identity(config)
    shown = lambda d, k: repr(d[k]) if k in d else "(unset)"  # noqa: E731
    keys = set(stored) | {k for k in new if k.startswith(OPEN)}
    changed = [f"{k} {shown(stored, k)} -> {shown(new, k)}" for k in sorted(keys)
               if k not in stored or k not in new or stored[k] != new[k]]
    return ", ".join(changed) or None
