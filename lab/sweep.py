"""Experiments as data: the arms of a config file x seeds, each trained into its own run.

An arm is a config file's argument (`configs/path.py:path_fox` is arm "path_fox" of
configs/path.py); a file's arms are its VARIANTS unless others are named. Every arm x seed is
the arm's config with `seed`, `arm` and the sweep's overrides set, trained into
<out>/<arm>/seed<seed> with the config's own training loop: a finished run is skipped, an
interrupted one resumes from its checkpoint, so rerunning a sweep completes it. Each run's
config.json then holds its arm and seed, which the reports (eval.py's results.json) carry and
lab/results/seeds.py groups by.
"""

from __future__ import annotations

import os
from typing import Callable

import ml_collections

from lab import files
from lab.checkpoints import complete_steps
from lab.cli import config_file
from lab.training import train


def arms_of(file: str, arms=None) -> tuple[str, ...]:
    """`arms`, or the config file's VARIANTS; ValueError naming the file where it has none."""
    if arms:
        return tuple(arms)
    variants = getattr(config_file(file), "VARIANTS", ())
    if not variants:
        raise ValueError(f"{file} declares no VARIANTS (the arms of its experiment); name the arms to sweep "
                         "with --arms=<arg>,<arg> (each one the file's argument, as in --config FILE:ARG)")
    return tuple(variants)


SET_BY_SWEEP = {"seed", "arm", "workdir"}


def configs(file: str, arms, seeds, out: str, overrides: dict | None = None) -> list[ml_collections.ConfigDict]:
    """The config of every arm x seed (arms outer): the arm's config with `overrides` ({dotted
    field: value}, as --config.<field>=<value>), seed, arm, and workdir <out>/<arm>/seed<seed>."""
    if set(overrides or {}) & SET_BY_SWEEP:
        raise ValueError(f"--config.{min(set(overrides) & SET_BY_SWEEP)} is set by the sweep for each run "
                         "(--seeds, --arms, <out>/<arm>/seed<seed>); leave it out")
    module, found = config_file(file), []
    for arm in arms_of(file, arms):
        for seed in seeds:
            config = module.get_config(arm)
            config.update_from_flattened_dict(dict(overrides or {}))
            config.seed, config.arm = int(seed), arm
            config.workdir = os.path.join(out, arm, f"seed{seed}")
            found.append(config)
    return found


def finished(config: ml_collections.ConfigDict) -> bool:
    """Whether the run of `config` has a complete checkpoint at its last step."""
    return max(complete_steps(files.join(config.workdir, "checkpoints")), default=-1) >= config.train.steps


def sweep(file: str, arms, seeds, out: str, overrides: dict | None = None, *, log=print,
          train_fn: Callable = train) -> tuple[list[str], dict | None]:
    """Train every arm x seed of the config file `file` not finished yet (resuming an interrupted
    one), in order: (their workdirs, None), or where a signal stopped a run (it saved its
    checkpoint) the sweep stops there: (the workdirs so far, that run's summary)."""
    workdirs = []
    for config in configs(file, arms, seeds, out, overrides):
        workdirs.append(config.workdir)
        if finished(config):
            log(f"{config.workdir}: finished (step {config.train.steps}), skipped")
            continue
        log(f"{config.workdir}: training arm {config.arm!r}, seed {config.seed}")
        summary = train_fn(config)
        if summary.get("interrupted"):
            return workdirs, summary
    return workdirs, None
