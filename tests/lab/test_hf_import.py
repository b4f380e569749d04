"""Importing Hugging Face checkpoints of the Llama family (lab/hf.py, import_checkpoint.py).

The parity fixtures under tests/data/hf/ are tiny random Llama / Mistral / Qwen2 models saved
by transformers, with the logits and greedy generations transformers computed for them
(tests/data/hf/make_fixtures.py, which needs torch and transformers; these tests do not).
Every fixture imported here and loaded as a run gives transformers' logits and its greedy
generation token for token (the KV-cache decode path).
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lab.checkpoints import checkpoint_manager, identity, stored_identity
from configs import default
from lab.cli import run_cli
from data import DataError, local_text, pipeline
from lab import retrieval
from lab.hf import PUBLISHED, import_checkpoint, model_fields, read_safetensors_header, tensor_index, train_flags
from lab.lengths import evaluate_runs
from lab.runs import held_out_stream, load_run
from lab.training import TrainingError, train
from models.lm import DecoderLM, ModelConfig, generate
from models.registry import make_scheme
from positional.rope import dynamic_frequencies, rope_frequencies
from helpers.tiny_setup import ROOT, cli

FIXTURES = os.path.join(ROOT, "tests", "data", "hf")
NAMES = ("llama", "llama_linear", "llama_dynamic", "llama_yarn", "mistral", "qwen2", "llama_bf16", "mistral_window",
         "qwen2_window", "qwen3", "smollm3", "olmo2", "gemma3", "phi3")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Every fixture imported once: {name: run directory}."""
    root = tmp_path_factory.mktemp("imported")
    return {name: import_checkpoint(os.path.join(FIXTURES, name), str(root / name))["workdir"] for name in NAMES}


def expected(name):
    return np.load(os.path.join(FIXTURES, name, "expected.npz"))


def logits_of(model, tokens):
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    return np.asarray(forward(state, jnp.asarray(tokens)[None]))[0]


def assert_logits_close(ours, theirs, rel=1e-5):
    """fp32 agreement: |difference| within `rel` of the logits' scale (the largest |logit|),
    the rounding of two fp32 computations that order their sums differently."""
    scale = max(1.0, float(np.abs(theirs).max()))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=rel * scale)


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_greedy_generation_equal_transformers(imported, name):
    config, model, step = load_run(imported[name])
    e = expected(name)
    assert step == 0
    for seq in ("a", "b"):  # b is 40 tokens, past max_position_embeddings (32) for dynamic scaling
        assert_logits_close(logits_of(model, e[f"tokens_{seq}"]), e[f"logits_{seq}"])
    # The prompt (28 tokens) and 8 new ones cross position 32: dynamic scaling changes its
    # frequencies while decoding, as transformers' generate does.
    np.testing.assert_array_equal(generate(model, jnp.asarray(e["prompt"])[None], 8)[0], e["generated"])


def test_what_the_import_writes(imported):
    with open(os.path.join(FIXTURES, "qwen2", "config.json")) as f:
        hf = json.load(f)
    config, model, _ = load_run(imported["qwen2"])
    assert config.model.qkv_bias and config.model.tie_embeddings and not config.model.scale_tied_logits
    assert config.model.norm_eps == hf["rms_norm_eps"] and config.seq_len == hf["max_position_embeddings"]
    assert dict(config.model.scheme_options) == {"base": 1e6, "layout": "half"}
    # The checkpoint carries the identity training stores, so train.py refuses to resume a
    # different model in this directory and points at init_from.
    manager = checkpoint_manager(os.path.join(imported["qwen2"], "checkpoints"), create=False)
    assert stored_identity(manager, imported["qwen2"]) == identity(config)
    llama = load_run(imported["llama"])[0]
    assert dict(llama.model.scheme_options) == {"base": 100.0, "layout": "half", "scaling": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_len": 32}
    assert load_run(imported["mistral"])[0].model.head_dim == 16  # not hidden_size / heads = 8


def test_sliding_windows_are_imported_per_layer(imported):
    """Mistral's window in every layer, Qwen2's from max_window_layers on; the fixtures' inputs
    pass the window (6), so the same model without it is far from transformers' logits."""
    windows = {name: [b.attn.scheme.sliding_window for b in load_run(imported[name])[1].blocks]
               for name in ("mistral_window", "qwen2_window", "mistral")}
    assert windows == {"mistral_window": [6, 6], "qwen2_window": [0, 6], "mistral": [0, 0]}
    config = load_run(imported["qwen2_window"])[0]
    assert (config.model.layer_kinds.to_dict(), config.model.layer_overrides) == ({"sliding": {"window": 6}}, "1=sliding")
    flags = train_flags(config)
    assert "--config.model.layer_kinds.sliding={'window': 6}" in flags and "--config.model.layer_overrides=1=sliding" in flags
    for name in ("mistral_window", "qwen2_window"):
        config, _, _ = load_run(imported[name])
        cfg = ModelConfig.from_dict({**config.model.to_dict(), "window": 0, "layer_overrides": ""})
        unwindowed = DecoderLM(cfg, rngs=nnx.Rngs(0))
        nnx.update(unwindowed, nnx.state(load_run(imported[name])[1]))
        e = expected(name)
        assert np.abs(logits_of(unwindowed, e["tokens_b"]) - e["logits_b"]).max() > 1e-2


def test_what_the_families_import(imported):
    """Each family's block and per-layer attention as the model config says them (the logits
    test above shows them equal to transformers; the next one that each one matters)."""
    def model_of(name):
        return load_run(imported[name])[0].model

    qwen3, smol, olmo, gemma, phi = (model_of(n) for n in ("qwen3", "smollm3", "olmo2", "gemma3", "phi3"))
    assert (qwen3.qk_norm, qwen3.norms, qwen3.qkv_bias, qwen3.layer_overrides) == ("head", "pre", False, "1=sliding")
    assert (smol.layer_kinds.to_dict(), smol.layer_overrides, smol.scheme) == ({"nope": {"scheme": "nope"}}, "1=nope",
                                                                              "rope")
    assert (olmo.qk_norm, olmo.norms, olmo.norm_offset) == ("projection", "post", 0.0)
    assert (gemma.norms, gemma.norm_offset, gemma.mlp_act, gemma.embed_scale, gemma.scale_dim, gemma.qk_norm) == (
        "sandwich", 1.0, "gelu_tanh", True, 24, "head")
    # The global layer's RoPE (base 100, linear x2) is the model's; the local kind's options whole.
    assert dict(gemma.scheme_options) == {"base": 100.0, "layout": "half", "scaling": "pi", "factor": 2.0}
    assert gemma.layer_kinds.to_dict() == {"sliding": {"window": 6, "scheme_options": {
        "base": 10.0, "layout": "half", "scaling": "none", "factor": 1.0}}} and gemma.layer_overrides == "0=sliding"
    options = dict(phi.scheme_options)
    assert (options["scaling"], options["factor"], options["rotary_dim"], options["original_max_len"]) == (
        "longrope", 4.0, 6, 32)
    assert tuple(options["long_factor"]) == (1.5, 3.0, 7.0)
    # A windowed layer decodes from a ring buffer of its window; the fixture's generation (36
    # tokens, equal to transformers above) passes it.
    model = load_run(imported["gemma3"])[1]
    assert [c["k"].shape[1] for c in model.init_cache(1, 36)] == [6, 36]


# In `make test` one per family; the others are slow (each moved the logits by > 1e-2 when added).
@pytest.mark.parametrize("name,field,wrong", [
    ("gemma3", "scale_dim", 0), ("smollm3", "layer_overrides", ""), ("qwen3", "layer_overrides", ""),
    ("phi3", "scheme_options.attention_factor", 1.0)] + [pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("gemma3", "mlp_act", "silu"), ("gemma3", "embed_scale", False), ("gemma3", "norm_offset", 0.0),
        ("gemma3", "layer_overrides", ""), ("phi3", "scheme_options.scaling", "none"))])
def test_the_fixtures_tell_each_mechanism_apart(imported, tmp_path, name, field, wrong):
    """Without any one of a family's mechanisms (Gemma's query scale, GeGLU, scaled embeddings,
    norms from 1, its local layers; SmolLM3's NoPE layer; Qwen3's window; Phi-3's LongRoPE and
    its temperature; Phi-3's partial rotary is the only one its three factors fit) the logits past the window and LongRoPE's switch are far from
    transformers'."""
    run = tmp_path / name
    shutil.copytree(imported[name], run)
    saved = json.loads((run / "config.json").read_text())
    *path, last = field.split(".")
    target = saved["model"]
    for key in path:
        target = target[key]
    target[last] = wrong
    (run / "config.json").write_text(json.dumps(saved))
    e = expected(name)
    assert np.abs(logits_of(load_run(str(run))[1], e["tokens_b"]) - e["logits_b"]).max() > 1e-2


def test_longrope_frequencies_by_hand():
    """Phi-3's LongRoPE: theta_i / short_i up to original_max_len, / long_i past it (by the
    call's length), q and k scaled by sqrt(1 + ln 4 / ln 32) on the rotated dims."""
    scheme = make_scheme("rope", num_heads=1, head_dim=8, base=100.0, scaling="longrope", factor=4.0,
                         original_max_len=32, short_factor=[1.0, 2.0, 4.0, 8.0], long_factor=(3.0, 3.0, 3.0, 3.0))
    theta = 100.0 ** (-np.arange(4) / 4)
    for length, factors in ((32, [1.0, 2.0, 4.0, 8.0]), (33, [3.0] * 4)):
        angles = scheme.angles(jnp.arange(length)[None])
        np.testing.assert_allclose(angles[0, -1, 0], (length - 1) * theta / np.array(factors), rtol=1e-6)
    assert scheme.temperature == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)))
    with pytest.raises(ValueError, match=r"^longrope RoPE scaling needs short_factor and long_factor of 4 positive "
                                         r"numbers each \(one per rotated pair\); got 3 and 4$"):
        make_scheme("rope", num_heads=1, head_dim=8, scaling="longrope", short_factor=(1, 1, 1), long_factor=(1,) * 4)


def test_layer_types_the_importer_does_not_know_get_one_line():
    hf = {**PUBLISHED["Qwen2.5-7B-YaRN"], "use_sliding_window": True, "num_hidden_layers": 2,
          "layer_types": ["full_attention", "chunked_attention"]}
    with pytest.raises(ValueError, match=r"^config.json: layer_types \['chunked_attention'\] cannot be imported: the "
                                         r"importer takes one of full_attention, sliding_attention per layer") as err:
        model_fields(hf, "config.json")
    assert "\n" not in str(err.value)
    gemma = {**PUBLISHED["Mistral-7B-v0.1"], "model_type": "gemma3_text", "num_hidden_layers": 2,
             "hidden_activation": "gelu_pytorch_tanh"}
    for change, message in (({"final_logit_softcapping": 30.0}, r"final_logit_softcapping=30.0 \(a tanh cap on the "
                                                                r"logits, Gemma 2's\) is not supported"),
                            ({"model_type": "gemma3"}, r"unsupported model_type 'gemma3' \(the multimodal Gemma 3: "
                                                       r"import a text-only gemma3_text checkpoint\)"),
                            ({"hidden_activation": "relu"}, r"hidden activation 'relu'; the gated MLP takes silu, "
                                                            r"gelu_pytorch_tanh"),
                            ({"rope_parameters": {"chunked_attention": {"rope_theta": 1.0}}},
                             r"RoPE parameters for the layer type\(s\) \['chunked_attention'\]")):
        with pytest.raises(ValueError, match="^config.json: " + message) as err:
            model_fields({**gemma, **change}, "config.json")
        assert "\n" not in str(err.value)


def test_bf16_checkpoints_stay_bf16_and_compute_in_bf16_like_transformers(imported, tmp_path):
    """bf16 parameters are stored as bf16 (the default fp32 compute matches transformers' fp32
    logits in test_logits_... above). With model.dtype=bfloat16, transformers' own bf16
    logits differ from its fp32 ones by a few bf16 roundings (2^-8 relative each) of logits up
    to ~25: ours must be no further from fp32 than transformers' bf16 is, hence within twice
    that of transformers' bf16 (two bf16 computations of the same fp32 one)."""
    config, model, _ = load_run(imported["llama_bf16"])
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    run = tmp_path / "bf16"
    shutil.copytree(imported["llama_bf16"], run)
    saved = json.loads((run / "config.json").read_text())
    saved["model"]["dtype"] = "bfloat16"  # not part of the identity: how the run computes
    (run / "config.json").write_text(json.dumps(saved))
    _, model, _ = load_run(str(run))
    e = expected("llama_bf16")
    for seq in ("a", "b"):
        ours, theirs, exact = logits_of(model, e[f"tokens_{seq}"]), e[f"logits_{seq}_bf16"], e[f"logits_{seq}"]
        their_error = np.abs(theirs - exact).max()
        assert 0.05 < their_error < 0.05 * np.abs(exact).max()  # bf16 compute, a few percent of the scale
        assert np.abs(ours - exact).max() <= their_error
        assert np.abs(ours - theirs).max() <= 2 * their_error


@pytest.mark.parametrize("name,option,wrong", [("llama", "layout", "interleaved"), ("llama_yarn", "ramp", "ratio"),
                                               ("llama", "low_freq_factor", 2.0)])
def test_the_fixtures_tell_a_wrong_rope_apart(imported, tmp_path, name, option, wrong):
    """The fixtures are sensitive: the other pair layout, YaRN's paper ramp instead of the
    code's, or another llama3 ramp move the logits far beyond the tolerance."""
    run = tmp_path / name
    shutil.copytree(imported[name], run)
    saved = json.loads((run / "config.json").read_text())
    saved["model"]["scheme_options"][option] = wrong
    (run / "config.json").write_text(json.dumps(saved))
    e = expected(name)
    assert np.abs(logits_of(load_run(str(run))[1], e["tokens_b"]) - e["logits_b"]).max() > 1e-2


def test_frequencies_by_hand():
    # D = 8, base 100: theta = 1, 0.1^0.5, 0.1, 0.1^1.5; at L = 32 the pairs' L / wavelength
    # r = 32 theta / 2 pi = 5.093, 1.611, 0.509, 0.161.
    theta = 100.0 ** (-np.arange(4) / 4)
    r = 32 * theta / (2 * math.pi)
    # llama3 (factor 8, low 1, high 4): keep r > 4, divide r < 1, blend by (r - 1) / 3 between.
    g = (r[1] - 1) / 3
    np.testing.assert_allclose(rope_frequencies(8, 100.0, "llama3", 8.0, 32),
                               [theta[0], (1 - g) * theta[1] / 8 + g * theta[1], theta[2] / 8, theta[3] / 8],
                               rtol=1e-12)
    # YaRN's index ramp (factor 4, beta 32 / 1): r = 32 at pair index -1.60 (floor: -2, clipped
    # to 0), r = 1 at 1.41 (ceil: 2); ramp i / 2 = 0, 0.5, 1, 1 is the weight of theta / s.
    index = 8 * np.log(32 / (2 * math.pi * np.array([32.0, 1.0]))) / (2 * np.log(100.0))
    np.testing.assert_allclose(index, [-1.596, 1.414], atol=1e-3)
    np.testing.assert_allclose(rope_frequencies(8, 100.0, "yarn", 4.0, 32, ramp="index"),
                               [theta[0], 0.5 * theta[1] / 4 + 0.5 * theta[1], theta[2] / 4, theta[3] / 4],
                               rtol=1e-12)
    # Unrounded: from 0 (the lower index is clipped at 0 either way) to 1.414.
    ramp = np.clip(np.arange(4) / index[1], 0, 1)
    np.testing.assert_allclose(rope_frequencies(8, 100.0, "yarn", 4.0, 32, ramp="index_exact"),
                               ramp * theta / 4 + (1 - ramp) * theta, rtol=1e-12)
    # Dynamic NTK (factor 2, L = 32): plain up to 32 tokens; at 64, NTK's base change with
    # s T / L - (s - 1) = 3: base 100 * 3^(8/6).
    plain = rope_frequencies(8, 100.0, "dynamic", 2.0, 32)
    np.testing.assert_allclose(plain, theta, rtol=1e-12)
    np.testing.assert_allclose(dynamic_frequencies(plain, 2.0, 32, jnp.int32(20)), theta, rtol=1e-6)
    np.testing.assert_allclose(dynamic_frequencies(plain, 2.0, 32, jnp.int32(64)),
                               rope_frequencies(8, 100.0 * 3 ** (8 / 6)), rtol=1e-6)


# config.json of published checkpoints, in transformers 4.x's layout (the fields that matter).
LLAMA31_8B, QWEN25_7B_YARN, MISTRAL_7B_V01 = (PUBLISHED[n] for n in ("Llama-3.1-8B", "Qwen2.5-7B-YaRN", "Mistral-7B-v0.1"))


def test_published_configs():
    llama = model_fields(LLAMA31_8B, "config.json")
    assert (llama["num_kv_heads"], llama["head_dim"], llama["mlp_dim"], llama["qkv_bias"]) == (8, 128, 14336, False)
    assert llama["scheme_options"] == {"base": 500000.0, "layout": "half", "scaling": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_len": 8192}
    qwen = model_fields(QWEN25_7B_YARN, "config.json")
    assert qwen["qkv_bias"] and not qwen["tie_embeddings"]
    assert qwen["scheme_options"] == {"base": 1e6, "layout": "half", "scaling": "yarn", "factor": 4.0,
                                      "original_max_len": 32768, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "ramp": "index", "attention_factor": pytest.approx(0.1 * math.log(4) + 1)}
    assert qwen["window"] == 0  # its sliding_window is off (use_sliding_window false)
    mistral = model_fields(MISTRAL_7B_V01, "config.json")
    assert mistral["scheme_options"] == {"base": 10000.0, "layout": "half"} and mistral["window"] == 4096
    # YaRN's factor from the lengths when the config leaves it out; an explicit attention factor.
    yarn = {**QWEN25_7B_YARN, "max_position_embeddings": 131072,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": None, "attention_factor": 1.5,
                                "original_max_position_embeddings": 32768, "truncate": False}}
    options = model_fields(yarn, "config.json")["scheme_options"]
    assert (options["factor"], options["attention_factor"], options["ramp"]) == (4.0, 1.5, "index_exact")


def copy_fixture(name, tmp_path):
    target = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), target)
    return target


def edit_config(directory, **changes):
    hf = json.loads((directory / "config.json").read_text())
    hf.update(changes)
    (directory / "config.json").write_text(json.dumps(hf))


def test_bad_checkpoints_are_named_in_one_line(tmp_path):
    run = str(tmp_path / "run")
    bad = copy_fixture("llama", tmp_path)
    edit_config(bad, model_type="gpt2")
    with pytest.raises(ValueError, match=r"config.json: unsupported model_type 'gpt2'; supported: llama, mistral, "
                                         r"qwen2, qwen3, smollm3, olmo2, gemma3_text, phi3$"):
        import_checkpoint(str(bad), run)
    edit_config(bad, model_type="llama", rope_scaling={"rope_type": "mrope", "factor": 4.0})
    with pytest.raises(ValueError, match=r"unsupported rope_scaling type 'mrope'; supported: default, linear, "
                                         r"dynamic, yarn, llama3, longrope, su$"):
        import_checkpoint(str(bad), run)
    edit_config(bad, rope_scaling=None, intermediate_size=48)
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.mlp\.down_proj\.weight in .*model\.safetensors has "
                                         r"shape \[32, 32\]; config\.json gives \[32, 48\]"):
        import_checkpoint(str(bad), run)
    # A shard's entry dropped from the index: that tensor is missing.
    sharded = copy_fixture("llama_linear", tmp_path)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight in "):
        import_checkpoint(str(sharded), run)
    # A tensor the model has no place for (Llama's attention_bias, say).
    extra = copy_fixture("qwen2", tmp_path)
    edit_config(extra, model_type="mistral")
    with pytest.raises(ValueError, match=r"tensor model\.layers\.\d\.self_attn\.[kqv]_proj\.bias in .* has no place"):
        import_checkpoint(str(extra), run)
    edit_config(bad, rope_scaling={"rope_type": "linear"}, intermediate_size=32)
    with pytest.raises(ValueError, match=r"config\.json has no 'factor', which a llama config needs"):
        import_checkpoint(str(bad), run)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        import_checkpoint(str(tmp_path / "nowhere"), run)
    assert not os.path.exists(run)  # nothing written by any of them
    os.makedirs(os.path.join(run, "something"))
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        import_checkpoint(os.path.join(FIXTURES, "llama"), run)


def test_damaged_or_misplaced_files_are_named_in_one_line(tmp_path):
    """A malformed config.json or shard index (was the bare JSON error), a source that is a
    file (was "does not exist"), a shard the index names but the folder lacks (was the raw
    "No such file")."""
    run = str(tmp_path / "run")
    bad = copy_fixture("llama", tmp_path)
    (bad / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(ValueError, match=rf"^{bad / 'config.json'} is not valid JSON \(.*\); the file is damaged"):
        import_checkpoint(str(bad), run)
    with pytest.raises(NotADirectoryError, match=rf"^checkpoint directory {bad / 'config.json'} is a file; pass the "
                                                 "directory that holds config.json"):
        import_checkpoint(str(bad / "config.json"), run)
    sharded = copy_fixture("llama_linear", tmp_path)
    index = sharded / "model.safetensors.index.json"
    shard = sorted(set(json.loads(index.read_text())["weight_map"].values()))[-1]
    (sharded / shard).unlink()
    with pytest.raises(FileNotFoundError, match=rf"^{index} names the shard {shard}, which is not in {sharded} "):
        import_checkpoint(str(sharded), run)
    index.write_text("[1, 2")
    with pytest.raises(ValueError, match=rf"^{index} is not valid JSON"):
        import_checkpoint(str(sharded), run)
    assert not os.path.exists(run)


def slow_import(tmp_path):
    """import_checkpoint.py of the llama fixture into tmp_path/run, its save held 60 s; returns
    the process once its unfinished folder is there, and that folder."""
    proc = subprocess.Popen([sys.executable, "tests/helpers/faulty.py", "import_checkpoint", "--fault=slow_save:60",
                             f"--source={os.path.join(FIXTURES, 'llama')}", f"--workdir={tmp_path / 'run'}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    partial = tmp_path / f".run.importing-{proc.pid}"
    deadline = time.time() + 120
    while not partial.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert partial.exists()
    return proc, partial


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_import_leaves_nothing_and_says_so_in_one_line(tmp_path, sig):
    proc, partial = slow_import(tmp_path)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig
    assert err.strip().splitlines()[-1] == f"interrupted: {signal.Signals(sig).name}" and "Traceback" not in err
    assert os.listdir(tmp_path) == []


def test_an_import_killed_outright_is_cleaned_up_by_the_next(tmp_path, capsys):
    proc, partial = slow_import(tmp_path)
    proc.kill()
    proc.wait()
    assert partial.exists()
    import_checkpoint(os.path.join(FIXTURES, "llama"), str(tmp_path / "run"))
    assert os.listdir(tmp_path) == ["run"]
    assert capsys.readouterr().err == (f"note: removed {partial}, an import into {tmp_path / 'run'} that process "
                                       f"{proc.pid} did not finish\n")


def test_safetensors_reader(tmp_path):
    """Headers name dtype, shape and byte offsets after the 8-byte length; a file cut short is
    refused by name; sharded and single-file checkpoints give the same tensors."""
    single = read_safetensors_header(os.path.join(FIXTURES, "llama", "model.safetensors"))
    sharded = tensor_index(os.path.join(FIXTURES, "llama_linear"))
    assert set(single) == set(sharded) and len(single) == 2 * 9 + 3
    assert single["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)
    bf16 = tensor_index(os.path.join(FIXTURES, "llama_bf16"))["model.norm.weight"]
    assert bf16.dtype == jnp.bfloat16 and bf16.array().dtype == jnp.bfloat16
    cut = tmp_path / "cut"
    shutil.copytree(os.path.join(FIXTURES, "llama"), cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"tensor .* in .*model\.safetensors: offsets .* the file is damaged"):
        tensor_index(str(cut))
    (cut / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json in"):
        tensor_index(str(cut))


def test_a_bad_checkpoint_is_one_line_through_run_cli(tmp_path, capsys):
    bad = copy_fixture("llama", tmp_path)
    edit_config(bad, model_type="gpt2")
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: import_checkpoint(str(bad), str(tmp_path / "run")))
    assert exit_.value.code == 1
    assert capsys.readouterr().err == (f"error: {bad / 'config.json'}: unsupported model_type 'gpt2'; supported: "
                                       "llama, mistral, qwen2, qwen3, smollm3, olmo2, gemma3_text, phi3\n")


def test_command_line_imports_and_eval_py_runs_on_it(tmp_path):
    """import_checkpoint.py, then eval.py on the import (Qwen2's vocabulary covers the byte
    tokens of the default held-out text, the run's data config)."""
    run = tmp_path / "qwen2"
    out = cli("import_checkpoint.py", f"--source={os.path.join(FIXTURES, 'qwen2')}", f"--workdir={run}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"into {run}" in out.stdout and "--config.init_from=" in out.stdout
    assert "has no tokenizer (tokenizer.json, tokenizer.model or *.tiktoken): the run reads text as byte-level" in \
        out.stderr
    evaluated = cli("eval.py", f"--workdirs={run}", "--max_multiplier=2", "--tokens=128", f"--out={tmp_path / 'eval'}")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["lengths"] == [32, 64, 128]
    assert all(np.isfinite(r["ppl"]) for r in results["runs"]["qwen2"]["results"])


def test_init_from_an_import(imported, tmp_path):
    """train.py's pretrain-then-extend path takes an import: zero steps with init_from store
    its parameters under a config built on configs/default.py, and they are transformers'.
    (Qwen2's vocabulary covers the byte tokens of the default data config training reads.)"""
    source = load_run(imported["qwen2"])[0]
    config = default.get_config("rope")
    config.model.update(source.model.to_dict())
    config.update(workdir=str(tmp_path / "extended"), init_from=imported["qwen2"], seq_len=16, batch_size=2)
    config.train.steps = 0
    train(config)
    _, model, _ = load_run(config.workdir)
    e = expected("qwen2")
    assert_logits_close(logits_of(model, e["tokens_b"]), e["logits_b"])
    # The import itself is not a run to resume: training in it is refused, and nothing moves.
    config.update(workdir=imported["qwen2"], init_from="")
    config.train.steps = 4
    before = sorted(os.listdir(imported["qwen2"]))
    with pytest.raises(TrainingError, match=r"holds a checkpoint imported from .* \(parameters only, no optimizer "
                                            r"state\) .* --config.init_from="):
        train(config)
    assert sorted(set(os.listdir(imported["qwen2"])) - {"lock"}) == before  # the lock it took, emptied


@pytest.mark.slow
def test_train_py_starts_from_an_import_with_the_flags_it_prints(tmp_path):
    run = tmp_path / "qwen2"
    out = cli("import_checkpoint.py", f"--source={os.path.join(FIXTURES, 'qwen2')}", f"--workdir={run}")
    assert out.returncode == 0, out.stderr[-2000:]
    command = out.stdout.strip().splitlines()[-1].split("python ", 1)[1].split()
    trained = cli(*command, f"--config.workdir={tmp_path / 'tuned'}", "--config.train.steps=2",
                  "--config.seq_len=16", "--config.batch_size=2", "--config.train.warmup_steps=1")
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert f"initialised parameters from {run} (step 0)" in trained.stdout


SHARDED = """
import json, math, sys
import jax, numpy as np, jax.numpy as jnp
import lab.hf as hf
from lab.runs import load_run
from lab.training import train
reads = []
place = jax.make_array_from_callback
def spy(shape, sharding, read):
    def recorded(index):
        out = read(index)
        reads.append([list(shape), list(out.shape)])
        return out
    array = place(shape, sharding, recorded)
    specs.append(str(array.sharding.spec))
    return array
specs = []
jax.make_array_from_callback = spy
hf.import_checkpoint(sys.argv[1], sys.argv[2], fsdp=8)
_, model, _ = load_run(sys.argv[2])
e = np.load(sys.argv[1] + "/expected.npz")
logits = np.asarray(model(jnp.asarray(e["tokens_b"])[None]))[0]
print(json.dumps({"devices": jax.device_count(), "reads": reads, "specs": specs,
                  "error": float(np.abs(logits - e["logits_b"]).max())}))
"""


def test_parameters_load_sharded_each_device_reading_its_slice(tmp_path):
    """On 8 simulated devices with fsdp=8, every parameter is split 8 ways and each device's
    read is 1/8 of its tensor; the saved run gives transformers' logits."""
    out = cli("-c", SHARDED, os.path.join(FIXTURES, "llama"), str(tmp_path / "run"),
              env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 8
    assert len(result["reads"]) == 8 * (2 * 9 + 3)  # one read per device per parameter
    assert all(math.prod(whole) == 8 * math.prod(part) for whole, part in result["reads"])
    assert all("fsdp" in spec for spec in result["specs"])
    assert result["error"] < 1e-4


# ---- the checkpoint's tokenizer (tests/data/hf/tokenizers/, written by make_tokenizers.py) -------------

TOKENIZERS = os.path.join(FIXTURES, "tokenizers")


def with_tokenizer(tmp_path, name, vocab=560):
    """The qwen2 fixture with `vocab` embedding rows (its 260, then random ones; its head is tied) and the files
    of the tokenizer fixture `name` beside its config.json."""
    target = copy_fixture("qwen2", tmp_path)
    tensors = read_safetensors_header(str(target / "model.safetensors"))
    arrays = {key: np.array(t.array()) for key, t in tensors.items()}
    embed = arrays["model.embed_tokens.weight"]
    extra = np.random.default_rng(0).normal(size=(vocab - len(embed), embed.shape[1]))
    arrays["model.embed_tokens.weight"] = np.concatenate([embed, extra]).astype(np.float32)
    header, blobs, offset = {}, [], 0
    for key, array in arrays.items():  # the safetensors layout lab/hf.py reads
        blobs.append(np.ascontiguousarray(array, "<f4").tobytes())
        header[key] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(blobs[-1])]}
        offset += len(blobs[-1])
    head = json.dumps(header).encode()
    (target / "model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    edit_config(target, vocab_size=vocab)
    for file in os.listdir(os.path.join(TOKENIZERS, name)):
        shutil.copy(os.path.join(TOKENIZERS, name, file), target)
    return target


def first_held_out_text(config) -> str:
    """The text of the first document of the run's held-out split, in eval_stream's order (by path)."""
    records = local_text.open_split(config.data, config.eval.split).records
    return min((records[i] for i in range(len(records))), key=lambda r: r["path"])["text"].decode("utf-8")


@pytest.mark.parametrize("name", ["json", "spm", "tiktoken"])
def test_the_import_copies_the_tokenizer_and_reads_text_with_it(tmp_path, name):
    """The tokenizer files land in <run>/tokenizer, the run's data config reads them, and its held-out stream is
    the library's ids of each document between the model's BOS and EOS (spm: special_tokens_map.json's; json:
    tokenizer_config.json's; tiktoken alone: Llama 3's after its 300 ranks, the json fixture's ids)."""
    pytest.importorskip({"json": "tokenizers", "spm": "sentencepiece", "tiktoken": "tiktoken"}[name])
    source = with_tokenizer(tmp_path, name)
    summary = import_checkpoint(str(source), str(tmp_path / "run"))
    run = tmp_path / "run"
    # The checkpoint's config.json too: its special token ids (null in the qwen2 fixture's) are the model's.
    assert sorted(os.listdir(run / "tokenizer")) == sorted([*os.listdir(os.path.join(TOKENIZERS, name)), "config.json"])
    for file in os.listdir(run / "tokenizer"):
        assert (run / "tokenizer" / file).read_bytes() == (source / file).read_bytes()
    config = load_run(str(run))[0]
    assert (config.data.tokenizer, config.data.tokenizer_path) == ("hf", str(run / "tokenizer"))
    assert f"--config.data.tokenizer_path={run / 'tokenizer'}" in train_flags(config)
    assert summary["tokenizer"].kind == {"json": "tokenizers", "spm": "sentencepiece", "tiktoken": "tiktoken"}[name]
    text = first_held_out_text(config)
    if name == "spm":
        import sentencepiece
        sp = sentencepiece.SentencePieceProcessor(model_file=str(source / "tokenizer.model"))
        expected = [sp.piece_to_id("<s>"), *sp.encode(text), sp.piece_to_id("</s>")]
    else:
        tokenizers = pytest.importorskip("tokenizers")
        lib = tokenizers.Tokenizer.from_file(os.path.join(TOKENIZERS, "json", "tokenizer.json"))
        lib.encode_special_tokens = True
        expected = [lib.token_to_id("<|begin_of_text|>"), *lib.encode(text, add_special_tokens=False).ids,
                    lib.token_to_id("<|end_of_text|>")]
    np.testing.assert_array_equal(held_out_stream(config, len(expected)), expected)
    os.rename(run, tmp_path / "moved")  # a moved run reads its own copy
    assert load_run(str(tmp_path / "moved"))[0].data.tokenizer_path == str(tmp_path / "moved" / "tokenizer")


def test_eval_and_retrieval_read_text_with_the_imported_tokenizer(tmp_path):
    """Perplexity and the retrieval tasks on an import with a tokenizer.json: prompts start with its BOS,
    needles, questions and answers are the library's ids, the haystack holds no BOS or EOS."""
    tokenizers = pytest.importorskip("tokenizers")
    lib = tokenizers.Tokenizer.from_file(os.path.join(TOKENIZERS, "json", "tokenizer.json"))
    bos, eos = lib.token_to_id("<|begin_of_text|>"), lib.token_to_id("<|end_of_text|>")
    ids = lambda text: lib.encode(text, add_special_tokens=False).ids  # noqa: E731
    run = import_checkpoint(str(with_tokenizer(tmp_path, "json")), str(tmp_path / "run"))["workdir"]
    lengths = evaluate_runs([run], max_multiplier=2, tokens=128, log=lambda *_: None)
    assert all(np.isfinite(r["ppl"]) for r in lengths["runs"]["run"]["results"])
    results = retrieval.retrieval_runs([run], tasks="passkey", lengths=[128], depths=[0.0, 1.0], examples=1,
                                       decode_max_length=128, log=lambda *_: None)
    for record in results["runs"]["run"]["tasks"]["passkey"]["records"]:
        assert record["answer"] == ids(record["answer_text"]) and len(record["answer_text"]) == 5
        assert "generated_text" in record
    config = load_run(run)[0]
    tok = pipeline.tokenizer(config.data)
    text = retrieval.haystack_text(config, tok, 128)
    assert bos not in text and eos not in text
    example = retrieval.make_example("passkey", tok, text, 128, 0.0, [0])
    assert example.prompt[0] == bos and len(example.prompt) + len(example.answer) == 128
    start, n = example.needles[0]
    value = lib.decode(example.answer.tolist())
    assert example.prompt[start:start + n].tolist() == ids(f"\nThe pass key is {value}. Remember it.\n")
    assert start == 1  # depth 0: right after BOS
    question = ids("\nWhat is the pass key? The pass key is ")
    assert example.prompt[-len(question):].tolist() == question


def test_a_tokenizer_that_is_not_the_models_is_refused_in_one_line(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    source = with_tokenizer(tmp_path, "json", vocab=300)  # the tokenizer has 302 tokens
    run = tmp_path / "run"
    with pytest.raises(SystemExit):
        run_cli(lambda: import_checkpoint(str(source), str(run)))
    assert capsys.readouterr().err == (f"error: {source / 'tokenizer.json'} has 302 tokens, more than the model's "
                                       f"embedding rows ({source / 'config.json'}: vocab_size 300); these tokenizer "
                                       "files are not this model's: replace them with the checkpoint's own\n")
    (source / "tokenizer.json").write_text("{")
    with pytest.raises(DataError, match=rf"^{source / 'tokenizer.json'} is not a tokenizer.json the tokenizers "
                                        r"library reads \(.*\); restore it from the checkpoint$"):
        import_checkpoint(str(source), str(run))
    assert not run.exists() and os.listdir(tmp_path) == ["qwen2"]  # nothing written


@pytest.mark.slow  # about 30 s: `make test-slow`
def test_analyze_py_runs_the_diagnostics_on_an_import(tmp_path):
    """The position-generalization analysis (3-axis and fake-distance fits, explicit f+g, perturbations,
    feature shift) runs on an imported checkpoint with its own tokenizer, in one command."""
    pytest.importorskip("tokenizers")
    run = import_checkpoint(str(with_tokenizer(tmp_path, "json")), str(tmp_path / "run"))["workdir"]
    out = tmp_path / "analysis"
    done = cli("analyze.py", f"--workdirs={run}", f"--out={out}", "--length=32", "--windows=2", "--perturb_windows=2",
               "--gammas=0.1", "--l_max=5", "--shift_multiplier=2", "--shift_windows=2")
    assert done.returncode == 0, done.stderr[-2000:]
    (run_results,) = json.loads((out / "analysis.json").read_text())["runs"].values()
    assert (run_results["scheme"], run_results["length"], len(run_results["layers"])) == ("rope", 32, 2)
    assert np.isfinite(run_results["perturbation"]["clean_ppl"]) and run_results["feature_shift"]["kl"]
    headings = [line for line in (out / "analysis.md").read_text().splitlines() if line.startswith("## ")]
    for part in ("Logit decompositions", "Observation 1", "Perturbation 'positions'", "Feature shift"):
        assert any(h.startswith(f"## {part}") for h in headings), part
