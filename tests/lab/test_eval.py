"""eval.py: every target scored once, perplexity by hand, reports, and the command line."""

import importlib
import json
import math
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lab import probes
from lab.evaluators import EVALUATORS
from lab.lengths import eval_impl, eval_lengths, evaluate_runs, perplexity, scoring_plan, window_step, write_report
from lab.probes import near_far_ranges
from lab.runs import Run, load_run, run_name
from models.lm import DecoderLM, ModelConfig, token_nll
from helpers.tiny_setup import ROOT, cli


@pytest.mark.parametrize("n_tokens,length,stride", [(100, 10, 0), (95, 10, 0), (100, 10, 3), (100, 10, 7),
                                                    (100, 10, 10), (100, 10, 30), (7, 10, 0), (64, 16, 4)])
def test_scoring_plan_scores_each_target_once(n_tokens, length, stride):
    starts, first = scoring_plan(n_tokens, length, stride)
    scored = np.concatenate([s + 1 + np.arange(f, length) for s, f in zip(starts, first)])
    assert len(np.unique(scored)) == len(scored)  # never twice
    # targets 1..N in order, N = max(n_tokens, length) exactly: the same at every length
    np.testing.assert_array_equal(scored, np.arange(1, max(n_tokens, length) + 1))
    assert starts.min() >= 0  # every window is exactly `length` tokens of the stream
    if 0 < stride < length:
        # every scored token but the first window's has at least length - stride tokens of context
        context = np.concatenate([np.arange(f, length) for f in first])
        assert context[length:].min() >= length - stride


def _old_scoring_plan(n_tokens, length, stride):
    """The plan before N was the same at every length (it rounded up to whole windows)."""
    if stride <= 0 or stride >= length:
        n_windows = max(1, -(-n_tokens // length))
        return np.arange(n_windows) * length, np.zeros(n_windows, np.int64)
    n_extra = max(0, -(-(n_tokens - length) // stride))
    starts = np.arange(n_extra + 1) * stride
    return starts, np.where(starts == 0, 0, length - stride)


@pytest.mark.parametrize("config", ["default", "demo", "demo:rope/fast", "accumulated", "espr", "path",
                                    "tapa:pretrain/rope", "tapa:extend/rope", "sessa:lm/sessa/0", "long_context"])
def test_the_plan_of_every_config_is_unchanged(config):
    """Where the tokens already fill whole windows (every protocol in configs/), the windows are
    the old ones: the numbers in docs/results stand."""
    module, _, arg = config.partition(":")
    c = importlib.import_module(f"configs.{module}").get_config(arg or None)
    for length in eval_lengths(c.seq_len, c.eval.multipliers):
        assert (max(c.eval.tokens, length) - length) % window_step(length, c.eval.stride) == 0
        for new, old in zip(scoring_plan(c.eval.tokens, length, c.eval.stride),
                            _old_scoring_plan(c.eval.tokens, length, c.eval.stride)):
            np.testing.assert_array_equal(new, old)


@pytest.mark.parametrize("n_tokens,stride", [(64, 4), (40, 0), (40, 5), (10, 0), (40, 16), (40, 30)])
def test_perplexity_by_brute_force(n_tokens, stride):
    """Each target t of 1..N scored once, by the first window of the rule that reaches it: windows
    of 16 tokens ending at 16, 16 + step, ... and one more ending at N."""
    length = 16
    model = DecoderLM(ModelConfig(vocab_size=30, d_model=16, num_layers=1, num_heads=2), rngs=nnx.Rngs(0))
    stream = np.random.default_rng(0).integers(0, 30, 200).astype(np.int32)
    got = perplexity(model, stream, length, n_tokens, stride=stride, batch_size=3)
    n = max(n_tokens, length)
    step = stride if 0 < stride < length else length
    ends = sorted(set(range(length, n + 1, step)) | {n})
    window_nll = {e: np.asarray(token_nll(model, jnp.asarray(stream[e - length:e + 1])[None])[0][0]) for e in ends}
    nll = [window_nll[end][t - (end - length) - 1] for t in range(1, n + 1) for end in [min(e for e in ends if e >= t)]]
    assert got["tokens"] == n and got["stride"] == (stride if 0 < stride < length else 0)
    assert got["ppl"] == pytest.approx(math.exp(np.mean(nll)), rel=1e-5)
    blockwise = perplexity(model, stream, length, n_tokens, stride=stride, batch_size=3, impl="blockwise")
    assert blockwise["ppl"] == pytest.approx(got["ppl"], rel=1e-5)


@pytest.mark.parametrize("tokens,stride", [(100, 20), (200, 0)])
def test_every_length_scores_the_same_tokens(tiny_run, tokens, stride, tmp_path):
    """--tokens below the longest length (raised to it), a stride that divides nothing and is
    longer than the shortest length (which cannot slide), and non-overlapping windows."""
    config, _ = tiny_run
    results = evaluate_runs([config.workdir], tokens=tokens, stride=stride, within_documents=False,
                            log=lambda *_: None)
    rows = results["runs"]["rope"]["results"]
    n = max(tokens, 128)
    assert results["lengths"] == [16, 32, 64, 128] and [r["tokens"] for r in rows] == [n] * 4
    assert results["tokens"] == n and results["tokens_asked"] == tokens and results["stride"] == stride
    assert [r["stride"] for r in rows] == [0, stride, stride, stride]
    header = write_report(results, str(tmp_path)).splitlines()[0]
    assert f"{n} scored tokens per length" in header
    assert ("(100 asked, raised to the longest length" in header) == (tokens == 100)
    assert ("non-overlapping windows at lengths 16," in header) == (stride == 20)


def test_evaluate_runs_writes_json_markdown_and_plot(tiny_run, tmp_path):
    config, _ = tiny_run
    results = evaluate_runs([config.workdir, config.workdir], max_multiplier=8, log=lambda *_: None)
    assert results["lengths"] == [16, 32, 64, 128, 256]
    run = next(iter(results["runs"].values()))
    assert run["step"] == 12
    at_train = [r for r in run["results"] if r["length"] == 32][0]
    assert at_train["ratio"] == 1.0
    assert all(r["tokens"] == 256 and np.isfinite(r["ppl"]) for r in run["results"])
    assert [r["impl"] for r in run["results"]][-2:] == ["blockwise", "blockwise"]  # blockwise_from 128
    table = write_report(results, str(tmp_path))
    assert "| 16 | 32 | 64 | 128 | 256 |" in table
    assert json.load(open(tmp_path / "results.json"))["lengths"] == results["lengths"]
    assert (tmp_path / "results.png").stat().st_size > 10_000


def test_the_length_plot_is_readable(monkeypatch):
    """docs/results/demo.json plotted: titles, the legend beside the plots (outside both axes),
    the ratio axis labelled at least every 0.25 over its range (was 1.0 and 2.0 only)."""
    from lab import lengths
    figures = []
    monkeypatch.setattr(lengths.files, "save_figure", lambda fig, path, **kw: figures.append(fig))
    monkeypatch.setattr(lengths.pyplot(), "close", lambda fig: None)
    lengths.plot(json.load(open(os.path.join(ROOT, "docs", "results", "demo.json"))), "unused.png")
    fig, = figures
    fig.canvas.draw()
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["perplexity by evaluation length",
                                               "relative to the training length (256, dashed)"]
    legend = fig.legends[0].get_window_extent()
    assert all(legend.x0 >= ax.get_window_extent().x1 for ax in axes)
    low, high = axes[1].get_ylim()
    labelled = [float(t.get_text()) for t in axes[1].get_yticklabels() if t.get_text() and low <= t.get_position()[1] <= high]
    assert labelled[0] <= 1.0 and labelled[-1] >= 1.75 and max(np.diff(labelled)) <= 0.25 + 1e-9, labelled


def test_load_run_restores_the_trained_parameters(tiny_run, monkeypatch):
    """The parameters are the checkpoint's, read into a model built from abstract shapes: no
    random initialisation and no optimizer state is ever made (init_state only abstract)."""
    import lab.runs
    from flax import nnx
    from lab.checkpoints import load_params
    from lab.state import init_state
    calls = []
    monkeypatch.setattr(lab.runs, "init_state", lambda *a, **kw: calls.append(kw) or init_state(*a, **kw))
    config, _ = tiny_run
    loaded_config, model, step = load_run(config.workdir)
    assert calls == [{"abstract": True}]
    assert step == 12 and loaded_config.model.scheme == "rope"
    assert np.isfinite(np.asarray(model(jnp.zeros((1, 4), jnp.int32)))).all()
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    _, saved = load_params(config.workdir, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
    assert all((np.asarray(a) == np.asarray(b)).all() for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(saved)))


def test_cli_compares_runs_and_reports_missing_ones(tiny_run, tmp_path):
    config, _ = tiny_run
    out = tmp_path / "cmp"
    run = cli("eval.py", f"--workdirs={config.workdir}", f"--out={out}", "--tokens=128")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| rope | rope |" in run.stdout and os.path.exists(out / "results.png")
    missing = cli("eval.py", f"--workdirs={tmp_path / 'nope'}", f"--out={out}")
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "not a training run directory" in missing.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("options,config,error", [
    ({"stride": -7}, {}, "lengths option stride=-7 is below 0; valid: an integer >= 0 (0: non-overlapping windows;"),
    ({"tokens": -5}, {}, "lengths option tokens=-5 is below 1; valid: an integer >= 1 (scored tokens per length)"),
    ({"max_multiplier": 0.25}, {}, "lengths option max_multiplier=0.25 is below every length multiplier"),
    # The run's config values get the same checks as the options.
    ({}, {"stride": -3}, "eval.stride=-3 is below 0; valid: an integer >= 0"),
    ({}, {"tokens": -1}, "eval.tokens=-1 is below 1; valid: an integer >= 1"),
])
def test_bad_lengths_options_are_one_line(tiny_run, options, config, error):
    run = Run(tiny_run[0].workdir, *load_run(tiny_run[0].workdir))
    run.config.eval.update(config)
    with pytest.raises(ValueError) as raised:
        evaluate_runs([run], **options)
    assert str(raised.value).startswith(error) and "\n" not in str(raised.value)


def test_cli_bad_stride_is_one_line_not_ignored(tiny_run, tmp_path):
    config, _ = tiny_run
    run = cli("eval.py", f"--workdirs={config.workdir}", f"--out={tmp_path}", "--stride=-7")
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1].startswith("error: lengths option stride=-7")


def test_probe_command_reports_every_layer(tiny_run, tmp_path):
    config, _ = tiny_run
    run = cli("eval.py", f"--workdirs={config.workdir}", f"--out={tmp_path}", "--probe_length=64")
    assert run.returncode == 0, run.stderr[-2000:]
    probes = json.load(open(tmp_path / "probes.json"))
    layers = probes["runs"]["rope"]["layers"]
    assert len(layers) == 2 and set(layers[0]["far_mass"]) == {"8", "32"}
    assert all(0 <= m <= 1 for rec in layers for m in rec["far_mass"].values())
    assert "| rope | 1 |" in run.stdout and (tmp_path / "probes.png").exists()


def test_near_far_command(tiny_run, tmp_path):
    config, _ = tiny_run
    run = cli("eval.py", f"--workdirs={config.workdir}", f"--out={tmp_path}", "--probe_length=64",
              "--near_far=0:4,48:64")
    assert run.returncode == 0, run.stderr
    result = json.load(open(tmp_path / "near_far.json"))["runs"]["rope"]
    assert result["n"] == 10000 and np.isfinite(result["mean"]) and result["std"] > 0
    assert "| rope |" in run.stdout and (tmp_path / "near_far.png").exists()


def test_run_names_tell_runs_with_the_same_folder_name_apart():
    runs = ["runs/tapa/extend/tapa", "runs/tapa/zeroshot/tapa", "runs/tapa/extend/rope"]
    assert [run_name(w, runs) for w in runs] == ["extend/tapa", "zeroshot/tapa", "rope"]
    seeds = ["runs/ssf/sessa_nofb/seed1", "runs/ssf/sessa_nofb/seed2"]  # seeds.py groups them by the arm
    assert [run_name(w, seeds) for w in seeds] == ["sessa_nofb/seed1", "sessa_nofb/seed2"]


def test_long_evaluation_switches_only_the_reference_to_blockwise():
    assert eval_impl("reference", 1024, 1024) == "blockwise"
    assert eval_impl("reference", 512, 1024) == "reference"
    assert eval_impl("pallas", 4096, 1024) == "pallas"


@pytest.mark.parametrize("texts,why", [
    (["a:b", "1:2"], "--near_far=a:b,1:2: 'a:b' is not two integers lo:hi; "),
    (["5:2", "8:16"], "--near_far=5:2,8:16: '5:2' is empty (lo >= hi); "),
    (["-1:4", "8:16"], "--near_far=-1:4,8:16: '-1:4' is negative; "),
    (["0:4", "32:100"], "--near_far=0:4,32:100: '32:100' reaches past the probe length 64; "),
    (["0:4"], "--near_far=0:4 has 1 ranges; "),
])
def test_bad_near_far_ranges_are_one_line(texts, why):
    with pytest.raises(ValueError) as raised:
        near_far_ranges("--near_far", texts, 64)
    assert str(raised.value) == why + ("valid: two distance ranges lo:hi,lo:hi (near, then far), integers with "
                                       "0 <= lo < hi <= 64")
    assert near_far_ranges("--near_far", ["0:4", "48:64"], 64) == {"near": (0, 4), "far": (48, 64)}


@pytest.mark.parametrize("flags,error", [
    (["--probe_length=64", "--near_far=a:b,1:2"], "error: --near_far=a:b,1:2: 'a:b' is not two integers lo:hi;"),
    (["--probe_length=-5"], "error: --probe_length=-5 is below 1; valid: an integer >= 1 (the window length"),
])
def test_cli_bad_probe_flags_are_one_line(tiny_run, tmp_path, flags, error):
    run = cli("eval.py", f"--workdirs={tiny_run[0].workdir}", f"--out={tmp_path}", *flags)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(error)


@pytest.mark.parametrize("evaluator,maps", [("transport", 6), ("near_far", 7)])  # 2 layers
def test_a_probe_too_long_for_memory_is_refused_at_once(tiny_run, monkeypatch, evaluator, maps):
    config = tiny_run[0]
    monkeypatch.setattr(probes, "available_memory", lambda: 8 * 2**30)
    options = {"near": (0, 4), "far": (8, 16)} if evaluator == "near_far" else {}
    start = time.perf_counter()
    with pytest.raises(ValueError) as raised:
        EVALUATORS[evaluator].run([config.workdir], length=100_000, log=lambda *_: None, **options)
    assert time.perf_counter() - start < 30
    need = maps * 2 * 2 * 100_000 ** 2 * 4 / 2**30  # maps x 2 windows x 2 heads x T^2 float32
    assert str(raised.value).startswith(f"the {'transport probes' if maps == 6 else 'near_far probe'} at length "
                                        f"100000: about {need:,.1f} GiB ({maps} float32 attention maps")
    assert "more than the 8.0 GiB available; lower the probe length (eval.py --probe_length" in str(raised.value)
    probes.check_memory(config, "the transport probes", 64, 2, maps, "")  # a normal length fits
    assert probes.available_memory() > 0


@pytest.mark.parametrize("stride", [0, 5])
def test_perplexity_within_documents_is_each_document_scored_alone(stride):
    """Spans score each document as if it were alone: the summed nll of three documents laid
    end to end, windows never crossing an end, is the sum of each one's perplexity run."""
    model = DecoderLM(ModelConfig(vocab_size=30, d_model=16, num_layers=1, num_heads=2), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 30, n).astype(np.int32) for n in (17, 40, 29)]
    offsets = np.cumsum([0] + [len(d) for d in docs])[:-1]
    spans = [(int(o), len(d) - 1) for o, d in zip(offsets, docs)]
    together = perplexity(model, np.concatenate(docs), 16, 0, stride=stride, batch_size=2, spans=spans)
    alone = [perplexity(model, d, 16, len(d) - 1, stride=stride, batch_size=2) for d in docs]
    assert together["tokens"] == sum(r["tokens"] for r in alone) == 16 + 39 + 28
    assert together["nll"] * together["tokens"] == pytest.approx(sum(r["nll"] * r["tokens"] for r in alone), rel=1e-5)


def test_within_documents_the_same_whole_documents_at_every_length(tiny_run, tmp_path):
    config, _ = tiny_run
    results = evaluate_runs([config.workdir], tokens=300, log=lambda *_: None)  # the default: within
    rows = results["runs"]["rope"]["results"]
    assert len({r["tokens"] for r in rows}) == 1 and results["tokens"] == rows[0]["tokens"] >= 300
    assert results["documents"] >= 1
    header = write_report(results, str(tmp_path)).splitlines()[0]
    assert f"within each of {results['documents']} held-out documents of at least 129 tokens" in header
    across = evaluate_runs([config.workdir], tokens=300, within_documents=False, log=lambda *_: None)
    assert "documents" not in across and across["tokens"] == 300  # laid end to end
    with pytest.raises(ValueError, match=r"^the held-out split has \d+ documents of at least 129 tokens, \d+ "
                                         r"targets in all, fewer than the 100000000 asked; lower --tokens"):
        evaluate_runs([config.workdir], tokens=10**8, within_documents=True, log=lambda *_: None)


def test_documents_spreads_the_targets_over_that_many_documents_and_keeps_each_ones_nll(tiny_run):
    """eval.documents N: the first N documents long enough, each its first max(longest,
    tokens / N) targets, the same at every length; each document's [summed NLL, targets] kept, and
    they add up to the length's perplexity (what a bootstrap over documents resamples). Too many
    asked: one line naming the field."""
    config, _ = tiny_run
    results = evaluate_runs([config.workdir], tokens=300, documents=5, log=lambda *_: None)
    assert results["documents"] == 5
    longest = max(results["lengths"])
    for r in results["runs"]["rope"]["results"]:
        docs = np.asarray(r["per_document"])
        assert docs.shape == (5, 2) and np.all(docs[:, 1] == max(longest, 60))  # 300 / 5 = 60 < 128
        assert docs[:, 1].sum() == r["tokens"] and docs[:, 0].sum() / r["tokens"] == pytest.approx(r["nll"], rel=1e-5)
    default = evaluate_runs([config.workdir], tokens=300, log=lambda *_: None)  # eval.documents 0: as before
    assert "per_document" not in default["runs"]["rope"]["results"][0]
    with pytest.raises(ValueError) as raised:
        evaluate_runs([config.workdir], tokens=300, documents=10**6, log=lambda *_: None)
    line = str(raised.value)
    assert line.startswith("eval.documents (--documents): the held-out split has ") and "\n" not in line


def test_a_run_too_large_for_the_device_is_one_line_before_reading(tiny_run, monkeypatch):
    """Its parameters' bytes per device against the device's memory, before anything is read."""
    import lab.runs
    config, _ = tiny_run
    monkeypatch.setattr(lab.runs, "device_memory", lambda: 1000)
    monkeypatch.setattr(lab.runs, "load_params", lambda *a: pytest.fail("read a checkpoint"))
    with pytest.raises(ValueError) as e:
        load_run(config.workdir)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{config.workdir}: its ")
    assert "parameters need 0.00 GiB per device, over the 0.00 GiB of a cpu device" in message
    monkeypatch.undo()
    assert lab.runs.device_memory() > 2 ** 30  # this host's memory, on a CPU


def test_load_run_in_bf16_halves_the_parameters(tiny_run):
    """param_dtype="bfloat16": the fp32 checkpoint's parameters read as bf16 (rounded, not
    re-initialised), half the bytes; the model still runs."""
    from flax import nnx
    config, _ = tiny_run
    _, full, _ = load_run(config.workdir)
    _, half, _ = load_run(config.workdir, param_dtype="bfloat16")
    a, b = (jax.tree.leaves(nnx.to_pure_dict(nnx.state(m, nnx.Param))) for m in (full, half))
    assert all(y.dtype == jnp.bfloat16 for y in b)
    assert all((np.asarray(x.astype(jnp.bfloat16), np.float32) == np.asarray(y, np.float32)).all() for x, y in zip(a, b))
    assert sum(y.nbytes for y in b) * 2 == sum(x.nbytes for x in a)
    assert np.isfinite(np.asarray(half(jnp.zeros((1, 4), jnp.int32)), np.float32)).all()



def test_eval_on_parameters_split_over_devices_scores_like_one_copy(tiny_run):
    """load_run with fsdp=2, tensor=2 over 4 CPU devices, in bf16: each device holds under half
    the parameters' bytes, and the lengths evaluator gives the perplexities of a copy per device."""
    config, _ = tiny_run
    code = f"""
import json, jax
from flax import nnx
from lab.lengths import evaluate_runs
from lab.runs import Pending, load_run
_, model, _ = load_run({config.workdir!r}, param_dtype="bfloat16", fsdp=2, tensor=2)
leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
whole = sum(x.nbytes for x in leaves)
mine = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == jax.devices()[0])
ppl = [[r["ppl"] for r in next(iter(evaluate_runs([run], max_multiplier=4, log=lambda *_: None)["runs"].values()))["results"]]
       for run in (Pending({config.workdir!r}, "bfloat16", 2, 2), Pending({config.workdir!r}, "bfloat16"))]
print(json.dumps({{"fraction": mine / whole, "ppl": ppl}}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["fraction"] < 0.5
    split, copy = result["ppl"]
    np.testing.assert_allclose(split, copy, rtol=1e-4)


def test_eval_dry_run_plans_every_length_from_the_config_alone(tiny_run, tmp_path, monkeypatch):
    """eval.py --dry_run on a directory holding only a run's config.json (no checkpoint): the
    lengths the evaluator would score, each compiled, its memory against the device's; a
    device too small for a length says NO for it."""
    import shutil
    import lab.lengths
    config, _ = tiny_run
    shutil.copy(os.path.join(config.workdir, "config.json"), tmp_path / "config.json")
    p = lab.lengths.plan(str(tmp_path), 8, param_dtype="bfloat16")
    assert [r["length"] for r in p["lengths"]] == [16, 32, 64, 128, 256]
    assert [r["impl"] for r in p["lengths"]][-2:] == ["blockwise", "blockwise"]  # blockwise_from 128
    assert all(r["fits"] and 0 < r["argument_bytes"] < r["total_bytes"] for r in p["lengths"])
    assert p["param_dtype"] == "bfloat16" and p["params"] > 0
    monkeypatch.setattr(lab.lengths, "device_memory", lambda: p["lengths"][2]["total_bytes"])
    assert [r["fits"] for r in lab.lengths.plan(str(tmp_path), 8, param_dtype="bfloat16")["lengths"]] == \
        [a["total_bytes"] <= p["lengths"][2]["total_bytes"] for a in p["lengths"]]
    run = cli("eval.py", f"--workdirs={tmp_path}", "--dry_run", "--max_multiplier=2")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith(f"dry run of {tmp_path}: ") and "| 64 | " in run.stdout and "| yes |" in run.stdout


def test_results_tables_name_a_scheme_with_the_options_a_run_set():
    """A yarn run is not labelled plain "rope" in the results tables."""
    from configs.default import get_config
    from lab.lengths import _model_name
    config = get_config("rope")
    assert _model_name(config) == "rope"
    config.model.scheme_options = {"scaling": "yarn", "factor": 4.0}
    assert _model_name(config) == "rope(factor=4.0, scaling=yarn)"
