"""train.py: learning, exact resume, SIGTERM / SIGKILL safety, the NaN guard, partial
checkpoints, sharding over 8 simulated devices, and readable errors from the command line."""

import json
import re
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from lab.checkpoints import checkpoint_manager, load_params
from lab.training import TrainingError, blow_up, dry_run, train, workdir_lock
from helpers.tiny_setup import ROOT, abstract_params, cli, overrides, tiny_config


def losses_of(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def test_loss_falls(tmp_path):
    summary = train(tiny_config(tmp_path, steps=60, checkpoint_every=60, lr=1e-2))
    losses = summary["losses"]
    assert len(losses) == 60 and all(np.isfinite(losses))
    assert np.mean(losses[-10:]) < np.mean(losses[:5]) - 0.6  # ~5.4 -> ~4.5 for this tiny model


def test_resume_continues_the_exact_loss_trajectory(tiny_run, tmp_path):
    config, summary = tiny_run
    uninterrupted = summary["losses"]
    # Replay a crash after step 4: copy the run, keep only its first checkpoint, and resume.
    config = config.copy_and_resolve_references()
    workdir = tmp_path / "copy"
    shutil.copytree(config.workdir, workdir)
    for step in (8, 12):
        shutil.rmtree(workdir / "checkpoints" / str(step))
    config.workdir = str(workdir)
    resumed = train(config)
    assert resumed["step"] == 12
    assert resumed["losses"] == uninterrupted[4:]  # bitwise: same program, same data, same state


def test_bf16_parameters_keep_fp32_optimizer_state(tiny_run, tmp_path):
    """train.param_dtype="bfloat16": bf16 parameters (in the checkpoint too), fp32 Adam
    moments, the losses of fp32 storage up to bf16 rounding, half the parameter bytes."""
    _, summary = tiny_run
    config = tiny_config(tmp_path / "bf16")
    config.train.param_dtype = "bfloat16"
    losses = train(config)["losses"]
    np.testing.assert_allclose(losses, summary["losses"], rtol=2e-2)
    manager = checkpoint_manager(tmp_path / "bf16" / "checkpoints", create=False)
    state = manager.restore(12, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    assert {x.dtype for x in jax.tree.leaves(state["params"])} == {np.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(state["opt_state"]) if x.ndim} == {np.dtype(np.float32)}
    assert load_params(str(tmp_path / "bf16"), abstract_params(config))[0] == 12  # eval restores it (as fp32)
    half = dry_run(config)
    config.train.param_dtype = "float32"
    assert dry_run(config)["argument_bytes"] - half["argument_bytes"] == 2 * half["params"]  # 4 -> 2 bytes
    with pytest.raises(ValueError, match="param_dtype='float16'; valid: float32, bfloat16"):
        train(tiny_config(tmp_path / "f16", param_dtype="float16"))
    # A run saved before the field existed loads as float32 storage.
    from lab.runs import load_run
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "bf16", old)
    saved = json.loads((old / "config.json").read_text())
    del saved["train"]["param_dtype"]
    (old / "config.json").write_text(json.dumps(saved))
    assert load_run(str(old))[2] == 12


def test_training_is_deterministic_given_the_seed(tiny_run, tmp_path):
    config, summary = tiny_run
    assert train(tiny_config(tmp_path / "again"))["losses"] == summary["losses"]
    other = tiny_config(tmp_path / "other")
    other.seed = 1
    assert not np.allclose(train(other)["losses"], summary["losses"])


def test_partial_checkpoint_is_skipped_with_a_warning(tiny_run, tmp_path, capsys):
    config, _ = tiny_run
    workdir = tmp_path / "damaged"
    shutil.copytree(config.workdir, workdir)
    # A checkpoint whose array data is missing, as after a crash mid-write on a filesystem
    # without atomic renames, and an unfinished save left behind by a killed process.
    for data_dir in (workdir / "checkpoints" / "12" / "state").rglob("d"):
        shutil.rmtree(data_dir)
    (workdir / "checkpoints" / "16.orbax-checkpoint-tmp-1").mkdir()
    step, params = load_params(str(workdir), abstract_params(config))
    assert step == 8
    assert "skipping unreadable checkpoint at step 12" in capsys.readouterr().err
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


@pytest.mark.parametrize("lr,warmup", [(1e3, 1), (1e30, 4)])
def test_nan_guard_stops_and_keeps_the_last_good_checkpoint(tmp_path, lr, warmup):
    """lr 1e3: the loss explodes (x 10^5 in a step, finite); lr 1e30 with warmup: nan / inf. The
    guard stops the run, and the checkpoint it names holds finite parameters whose loss was
    sane: a checkpoint's own parameters (after its step's update) are scored before it is kept
    (before, lr 1e3 kept step 2's, whose loss is 3e6)."""
    config = tiny_config(tmp_path, steps=30, lr=lr, warmup_steps=warmup, checkpoint_every=1, weight_decay=0.0)
    pattern = r"(loss|parameters) (became (nan|inf)|exploded to).*Last good checkpoint: step (\d+)"
    with pytest.raises(TrainingError, match=pattern) as e:
        train(config)
    assert "\n" not in str(e.value)
    last_good = int(str(e.value).split("Last good checkpoint: step ")[1].split()[0])
    manager = checkpoint_manager(tmp_path / "checkpoints", create=False)
    assert manager.latest_step() == last_good
    step, params = load_params(str(tmp_path), abstract_params(config))
    assert step == last_good
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def test_a_slow_divergence_names_a_good_checkpoint_and_resumes_from_it(tmp_path, capsys):
    """lr 10 (warmup 20): the loss climbs from 5.9 through 10-20 for a dozen steps, below the
    explosion threshold at every step, until it passes 3 x the median. The checkpoint the guard
    names is one that was in line with the run (its parameters' loss on the fixed batch within
    1.5 x the lowest at a checkpoint so far; its logged loss too, within 1.5 x the lowest logged
    before), the later ones are moved aside (not deleted), and a rerun at a sane
    lr resumes from it and ends below the start's loss, within 1.5 x that of a run at that lr
    from the start (its optimizer moments come from the diverging run). (Before: the newest
    finite checkpoint was named, with a loss several times the start's; "step None".)"""
    config = tiny_config(tmp_path, steps=60, lr=10.0, warmup_steps=20, checkpoint_every=2, keep_checkpoints=3,
                         explode_factor=3.0)
    with pytest.raises(TrainingError, match=r"loss exploded to .*Last good checkpoint: step (\d+)") as e:
        train(config)
    message = str(e.value)
    assert "\n" not in message and "None" not in message
    good = int(message.split("Last good checkpoint: step ")[1].split()[0])
    losses = {json.loads(x)["step"]: json.loads(x)["loss"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()}
    # It did diverge, slowly: the logged losses (the step that exploded is not logged) climb well
    # past the start's (over 3x where this test was written; 2.7x in a fresh install of 2026-11-28).
    assert max(losses.values()) > 2.5 * losses[1]
    assert losses[good] <= 1.5 * min(losses[s] for s in losses if s <= good)
    assert "out of line with the run" in capsys.readouterr().err
    moved = sorted(p.name.split("-")[0] for p in (tmp_path / "checkpoints.diverged").iterdir())
    assert moved and all(int(m) > good for m in moved) and "were out of line with the run and are moved" in message
    assert checkpoint_manager(tmp_path / "checkpoints", create=False).latest_step() == good

    config.train.update(lr=3e-3, warmup_steps=2)
    resumed = train(config)
    fresh = train(tiny_config(tmp_path / "fresh", steps=60, checkpoint_every=2, keep_checkpoints=3))
    end, fresh_end = (float(np.mean(r["losses"][-5:])) for r in (resumed, fresh))
    assert resumed["step"] == 60 and end < losses[1] and end <= 1.5 * fresh_end, (end, fresh_end)


def test_batches_of_other_difficulty_leave_the_checkpoints_in_line(tmp_path, monkeypatch, capsys):
    """Steps 5-30 on easy batches (their losses reported at 0.3x, as a long easy file in the
    stream gives) pull the run's running median down; the checkpoints during and after that
    stretch are still in line and saved, because a checkpoint is judged by its parameters' loss
    on one fixed batch, not against batch losses. (Before: every checkpoint from step 12 on was
    out of line and, past keep_checkpoints, not saved; the last good one stayed step 8.)"""
    from lab import training
    real = training.make_train_step

    def easy_stretch(*args, **kwargs):
        step, count = real(*args, **kwargs), iter(range(1, 10**6))

        def reported(state, batch):
            state, metrics = step(state, batch)
            return state, {**metrics, "loss": metrics["loss"] * (0.3 if 5 <= next(count) <= 30 else 1.0)}
        return reported

    monkeypatch.setattr(training, "make_train_step", easy_stretch)
    summary = train(tiny_config(tmp_path, steps=48, checkpoint_every=4, keep_checkpoints=3))
    losses = summary["losses"]
    assert max(losses[30:]) > 2 * np.median(losses[:30])  # ordinary batches far above the easy median
    assert "out of line" not in capsys.readouterr().err
    assert sorted(checkpoint_manager(tmp_path / "checkpoints", create=False).all_steps()) == [40, 44, 48]


def test_a_resumed_run_judges_its_checkpoints_against_the_runs_lowest(tmp_path, capsys):
    """Trained sanely to step 8, then resumed at lr 10: the first checkpoint after the resume is
    judged against the lowest loss of the fixed batch before it (kept in the checkpoint), so it
    is out of line and step 8 stays the last good one. (A guard that started afresh at each
    start took whatever the first checkpoint after a resume held for in line.)"""
    train(tiny_config(tmp_path, steps=8, checkpoint_every=4))
    assert "out of line" not in capsys.readouterr().err
    train(tiny_config(tmp_path, steps=12, checkpoint_every=4, lr=10.0, warmup_steps=1, explode_factor=100.0))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "out of line" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: step 12 is out of line with the run"), warnings
    assert warnings[0].endswith("saved, but step 8 stays the last good checkpoint"), warnings


def test_blow_up_names_what_and_the_scale():
    assert blow_up(5.0, True, [], 10.0) is None and blow_up(40.0, True, [5.0, 4.0], 10.0) is None
    assert blow_up(float("nan"), True, [5.0], 10.0) == "loss became nan"
    assert blow_up(5.0, False, [5.0], 10.0) == "parameters became nan/inf"
    assert blow_up(46.0, True, [5.0, 4.0, 4.5], 10.0).startswith("loss exploded to 46, more than "
                                                                  "train.explode_factor=10 x the median 4.5")
    assert blow_up(1e9, True, [5.0], 0.0) is None  # the explosion check off


def test_no_checkpoint_yet_says_so(tmp_path):
    config = tiny_config(tmp_path, steps=30, lr=1e3, warmup_steps=1, checkpoint_every=10, weight_decay=0.0)
    with pytest.raises(TrainingError, match=r"No checkpoint in line with the run was saved\. Lower train\.lr .* starts again"):
        train(config)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_signal_mid_run_leaves_a_good_checkpoint(tmp_path, sig, capsys):
    config = tiny_config(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "train.py", "--config", "configs/default.py", *overrides(config),
         "--config.train.steps=100000", "--config.train.checkpoint_every=25"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    # Past step 60 and the step-50 save committed (saves are asynchronous: under load one can
    # still be in flight ten steps later), so a kill lands after a good checkpoint.
    while time.time() < deadline and (not metrics.exists() or len(losses_of(tmp_path)) < 60
                                      or not (tmp_path / "checkpoints" / "50").is_dir()):
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    manager = checkpoint_manager(tmp_path / "checkpoints", create=False)
    found = load_params(str(tmp_path), abstract_params(config))
    with workdir_lock(str(tmp_path)):  # free again, however the run ended
        pass
    took_over = [line for line in capsys.readouterr().err.splitlines() if f"pid {proc.pid}" in line]
    if sig != signal.SIGKILL:
        # Non-zero, the shell's way (128 + the signal's number), with one line saying how to go on.
        assert proc.returncode == 128 + sig, err
        step = max(losses_of(tmp_path))
        assert err.strip().splitlines()[-1] == (
            f"interrupted: {sig.name} at step {step}; checkpoint saved at step {step} in "
            f"{tmp_path / 'checkpoints'}. Rerun the same command to continue.")
        assert "done:" not in out
        # The save on a signal is at the step the run stopped, not only the periodic one.
        assert found[0] == step == manager.latest_step()
        assert not took_over  # the run released its lock
    else:
        assert found[0] >= 50 and found[0] % 25 == 0
        assert len(took_over) == 1 and took_over[0].startswith("warning: ")  # the dead run's lock


def test_sharded_training_on_8_devices_matches_one_device(tiny_run, tmp_path):
    config, summary = tiny_run
    run = cli("train.py", "--config", "configs/default.py", *overrides(tiny_config(tmp_path)),
              "--config.train.steps=12", "--config.train.checkpoint_every=4",
              "--config.mesh.data=2", "--config.mesh.fsdp=4",
              env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert run.returncode == 0, run.stderr[-2000:]
    sharded = losses_of(tmp_path)
    np.testing.assert_allclose([sharded[s] for s in range(1, 13)], summary["losses"], rtol=2e-4)
    # The sharded checkpoint restores on this single-device process (a different mesh).
    assert load_params(str(tmp_path), abstract_params(config))[0] == 12
    # ... and training resumes from it on one device and on a tensor x sequence mesh alike.
    shutil.copytree(tmp_path, tmp_path / "one", ignore=shutil.ignore_patterns("one"))
    one = train(tiny_config(tmp_path / "one", steps=16))
    run = cli("train.py", "--config", "configs/default.py", *overrides(tiny_config(tmp_path)),
              "--config.train.steps=16", "--config.train.checkpoint_every=4",
              "--config.mesh.tensor=2", "--config.mesh.sequence=4",
              env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert one["step"] == 16 and len(one["losses"]) == 4
    np.testing.assert_allclose([losses_of(tmp_path)[s] for s in range(13, 17)], one["losses"], rtol=2e-4)


@pytest.mark.parametrize("flag,message", [
    ("--config.model.scheme=spiral", "unknown position scheme 'spiral'; registered schemes: alibi, "),
    ("--config.model.head_dim=7", "head_dim must be even"),
    ("--config.data.source_dir=/no/such/dir", "/no/such/dir"),
    ("--config.mesh.data=3", "does not fit 1 devices"),
    ("--config.init_from=/no/such/run", "/no/such/run' does not exist"),
    ("--config.train.stepz=3", "unknown config field 'train.stepz'"),
    ("--config.modle.d_model=1", "unknown config field 'modle'; Did you mean \"model\""),
    ("--config.model.scheme_options.gate_bias=5.0", "scheme 'rope' has no option(s) ['gate_bias']"),
    ("--config.model.mixer_options.solve=blocked", "model.mixer='attention' has none"),
    ("--config.evals=lengths,nope", "unknown evaluator in config.evals 'nope'; valid: lengths, transport, "),
])
def test_bad_input_exits_with_one_readable_line(tmp_path, flag, message):
    run = cli("train.py", "--config", "configs/default.py", *overrides(tiny_config(tmp_path)), flag)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr
    assert message in run.stderr.strip().splitlines()[-1]


def test_empty_dataset_dir_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    run = cli("train.py", "--config", "configs/default.py", *overrides(tiny_config(tmp_path / "w")),
              f"--config.data.source_dir={tmp_path / 'empty'}")
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "empty" in run.stderr.strip().splitlines()[-1]


def test_extend_from_a_pretrained_run_with_a_rope_extension(tiny_run, tmp_path):
    """Pretrain-then-extend: init_from at twice the length with YaRN switched on; a zero-step
    extension stores the pretrained parameters under the new scheme options (zero-shot)."""
    config, _ = tiny_run
    source = config.workdir

    def extension(workdir, steps):
        c = tiny_config(workdir, steps=steps, checkpoint_every=4)
        c.init_from, c.seq_len, c.batch_size = source, 64, 4
        c.model.scheme_options.update(scaling="yarn", factor=4.0, original_max_len=32)
        return c

    zero = train(extension(tmp_path / "zeroshot", 0))
    assert zero["step"] == 0 and zero["losses"] == []
    _, pre = load_params(source, abstract_params(config))
    step, zs = load_params(str(tmp_path / "zeroshot"), abstract_params(config))
    assert step == 0
    jax.tree.map(np.testing.assert_array_equal, zs, pre)
    saved = json.load(open(tmp_path / "zeroshot" / "config.json"))
    assert saved["model"]["scheme_options"]["scaling"] == "yarn" and saved["seq_len"] == 64
    extended = train(extension(tmp_path / "extend", 4))
    assert extended["step"] == 4 and all(np.isfinite(extended["losses"]))


@pytest.mark.parametrize("scheme", ["rope", "so2_learned_qkv", "path_fox"])
def test_one_initialisation_path_abstract_and_built(tmp_path, scheme):
    """The abstract state (the dry run's) has the real state's shapes, dtypes and shardings, and
    the real one holds, bit for bit, the parameters of an eager model build (the committed
    results were trained from those)."""
    from flax import nnx

    from lab.state import init_state, make_mesh, model_config
    from models.lm import DecoderLM
    config = tiny_config(tmp_path, scheme)
    mesh = make_mesh(config)
    _, _, _, _, state = init_state(config, 64, mesh)
    _, _, _, _, abstract = init_state(config, 64, mesh, abstract=True)
    assert jax.tree.structure(state) == jax.tree.structure(abstract)
    for x, a in zip(jax.tree.leaves(state), jax.tree.leaves(abstract)):
        assert (x.shape, x.dtype, x.sharding) == (a.shape, a.dtype, a.sharding)
    eager = nnx.to_pure_dict(nnx.state(DecoderLM(model_config(config, 64), rngs=nnx.Rngs(config.seed)),
                                       nnx.Param))
    for x, y in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(eager)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("position", [True, False])
def test_weight_decay_takes_matrices_and_position_matrices_only_when_asked(position):
    """One AdamW step with zero gradients is the decay alone: matrices shrink by lr * weight_decay,
    norms' scales do not, and the learned step table of so2_learned_qkv (an attention layer's
    `features`) shrinks only with train.decay_position_params."""
    from flax import nnx

    from configs import default
    from lab.state import make_optimizer
    from models.lm import DecoderLM, ModelConfig
    cfg = default.get_config().train
    cfg.update(lr=0.1, warmup_steps=0, weight_decay=0.5, decay_position_params=position)
    model = DecoderLM(ModelConfig(vocab_size=30, d_model=32, num_layers=1, num_heads=2, scheme="so2_learned_qkv"),
                      rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params["blocks"][0]["attn"]["features"]["table"] = jnp.ones((30, 8))  # initialised at 0
    tx, schedule = make_optimizer(cfg)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    new = jax.tree.map(lambda p, u: p + u, params, updates)
    layer, old = new["blocks"][0], params["blocks"][0]
    shrink = 1 - float(schedule(0)) * 0.5
    assert shrink == pytest.approx(0.95)
    np.testing.assert_allclose(layer["attn"]["q"]["kernel"], shrink * old["attn"]["q"]["kernel"], rtol=1e-6)
    np.testing.assert_array_equal(layer["attn_norm"]["scale"], old["attn_norm"]["scale"])
    np.testing.assert_allclose(layer["attn"]["features"]["table"], shrink if position else 1.0, rtol=1e-6)


def test_loss_weight_weights_tokens_as_data_retrieval_answer_weight_asks(tmp_path):
    """The training loss with a batch's 'loss_weight' (a retrieval mix with
    data.retrieval_answer_weight) is the weighted mean NLL: all-ones weights change nothing, and
    one token weighted far above the rest gives that token's NLL alone (a weight of 1 on it, 0 elsewhere)."""
    from lab.state import init_state, make_mesh
    from lab.state import make_loss
    config = tiny_config(tmp_path)
    graphdef, rest, _, _, state = init_state(config, 64, make_mesh(config))
    loss = jax.jit(make_loss(graphdef, rest, config))
    tokens = jax.random.randint(jax.random.key(0), (2, 33), 0, 64)
    batch = {"tokens": tokens, "segment_ids": jnp.ones_like(tokens), "positions": jnp.arange(33)[None].repeat(2, 0)}
    one = jnp.zeros(tokens.shape).at[1, 20].set(1.0)
    plain = loss(state["params"], batch, None)
    ones = loss(state["params"], {**batch, "loss_weight": jnp.ones(tokens.shape)}, None)
    assert float(ones) == pytest.approx(float(plain), rel=1e-6)
    alone = loss(state["params"], {**batch, "loss_weight": one}, None)
    weighted = loss(state["params"], {**batch, "loss_weight": 1 + 1e7 * one}, None)
    assert float(weighted) == pytest.approx(float(alone), rel=1e-4)
    assert abs(float(alone) - float(plain)) > 1e-3  # the one token differs from the mean


@pytest.mark.parametrize("data", ["text", "task", "mix", "weighted_mix"])
def test_the_dry_run_compiles_the_batch_training_feeds(tmp_path, data):
    """The dry run's train step takes the batch the config's loader yields (data.batch): the same
    keys and dtypes for plain text, a synthetic task (answer weights), and a retrieval mix with
    and without an answer weight."""
    from data import pipeline, tasks
    config = tiny_config(tmp_path)
    if data == "task":
        config.data.name = "diffuse_mqar"
        config.data.task = tasks.default_options("diffuse_mqar")
        config.seq_len = tasks.get_task(config.data).max_len("train")
    elif data != "text":
        config.seq_len = 320
        config.data.update(retrieval_mix=1.0, retrieval_answer_weight=4.0 if data == "weighted_mix" else 1.0)
    loader = pipeline.Streams(config.data, seed=0, batch_size=config.batch_size, seq_len=config.seq_len + 1)
    fed = {k: str(v.dtype) for k, v in next(loader).items()}
    assert dry_run(config)["batch"] == fed
    assert ("loss_weight" in fed) == (data in ("task", "weighted_mix"))


def test_progress_lines_name_the_run_and_the_time_left_and_a_finished_rerun_says_so(tiny_run, tmp_path, capsys):
    """Without a terminal: one line per logged step with the run's name; from the second one on
    (the first pays for compiling) tokens/s and an ETA. Rerunning a finished run says it is
    finished and where its losses are."""
    config = tiny_config(tmp_path / "named", steps=6)
    train(config)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("named step ")]
    assert len(lines) == 6 and "tok/s" not in lines[0], lines
    assert all(re.search(r"loss \d+\.\d{4}  [\d,]+ tok/s  ETA 0:00:\d\d$", x) for x in lines[1:]), lines
    train(config)
    out = capsys.readouterr().out
    assert f"already finished: step 6 of 6 in {tmp_path / 'named'}" in out and "metrics.jsonl" in out
