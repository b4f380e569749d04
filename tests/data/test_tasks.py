"""Synthetic tasks: determinism, the SymbolSoup generator's statistics, Diffuse MQAR lags and
answers, padded rows and masks, masked training, task accuracy by hand, and the command line."""

import collections
import json
import math
import random

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from data import DataError, tasks
from lab.lengths import task_accuracy
from models.lm import DecoderLM, ModelConfig
from helpers.tiny_setup import cli, tiny_config

SOUP = tasks.SymbolSoup()
MQAR = tasks.DiffuseMQAR(pairs=4, queries=3, lag_min=4, lag_max=10, eval_lags=(4, 10, 20, 40))


def data_config(name, **options):
    return ml_collections.ConfigDict(dict(name=name, task=options))


@pytest.mark.parametrize("task", [SOUP, MQAR])
def test_examples_are_a_function_of_seed_split_and_index(task):
    again = type(task)(**{**task.__dict__})
    for split in tasks.SPLITS:
        for i in (0, 7):
            a, b = task.example(split, i), again.example(split, i)
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_array_equal(a.answer, b.answer)
    other_seed = type(task)(**{**task.__dict__, "seed": 1})
    assert not np.array_equal(task.example("train", 0).tokens, other_seed.example("train", 0).tokens)
    assert not np.array_equal(task.example("train", 0).tokens, task.example("test", 0).tokens)


def test_symbolsoup_lengths_format_and_balanced_classes():
    counts = collections.Counter()
    for i in range(200):
        symbols = SOUP.symbols_of("test", i)
        letters = sum(s in tasks.LETTERS for s in symbols)
        # One token per character, whitespace included: M letters make 2 M + 13 tokens, plus the class.
        assert len(symbols) == 2 * letters + 13 + 1 and 400 <= len(symbols) - 1 <= 600
        assert symbols[:2] == ["<bos>", "\n"] and symbols[-4:-1] == ["<sep>", " ", "<label>"]
        assert collections.Counter(symbols)["<sep1>"] == collections.Counter(symbols)["<sep2>"] == 2
        counts[symbols[-1]] += 1
        example = SOUP.example("test", i)
        assert example.answer.tolist() == [0] * (len(symbols) - 1) + [1]  # only the class is scored
    assert counts == {f"CLASS_{k}": 10 for k in range(20)}  # 200 examples, 20 classes


def _markov_log_likelihood(style, letters):
    """log P(letters) under a style's Markov chain with the official weights (no motifs, no flips)."""
    total, prev = 0.0, None
    for t in letters:
        w = {x: style.unigram[x] * (4.0 if prev and (prev, x) in style.bigrams else 1.0)
             for x in tasks.LETTERS}
        total += math.log(w[t] / sum(w.values()))
        prev = t
    return total


def test_symbolsoup_label_is_the_pair_of_block_styles():
    """The class names (left style, right style) = (k // 5, k % 5): a likelihood classifier over
    the two blocks recovers it far above chance (1/20); a block can be a few letters long, so
    some examples are ambiguous (30 of these 40 are recovered)."""
    right = 0
    for i in range(40):
        symbols = SOUP.symbols_of("validation", i)
        starts = [j for j, s in enumerate(symbols) if s == "<sep1>"]
        blocks = [[s for s in symbols[j:symbols.index("<sep2>", j)] if s in tasks.LETTERS] for j in starts]

        def score(k):
            left, rgt = tasks.LEFT_STYLES[k // 5], tasks.RIGHT_STYLES[k % 5]
            return max(_markov_log_likelihood(left, a) + _markov_log_likelihood(rgt, b)
                       for a, b in (blocks, blocks[::-1]))

        right += max(range(20), key=score) == int(symbols[-1].split("_")[1])
    assert right >= 24


def test_style_tables_have_the_official_weights():
    for style in tasks.LEFT_STYLES + tasks.RIGHT_STYLES:
        assert sorted(collections.Counter(style.unigram.values()).items()) == [(1.0, 8), (2.0, 4), (3.0, 4)]
        assert len(style.bigrams) == 20  # 4 cyclic + 4 + 4 self pairs + 4 (p_i, s_i) + 4 (s_i, p_i)
    assert len(tasks.MOTIFS) == 14 + 13 + 12


def test_flip_noise_rate():
    rng = random.Random(0)
    clean = [rng.choice(tasks.LETTERS) for _ in range(100_000)]
    flipped = tasks.flip_letters(random.Random(1), clean, 0.03)
    rate = np.mean([a != b for a, b in zip(clean, flipped)])
    assert abs(rate - 0.03) < 4 * math.sqrt(0.03 * 0.97 / len(clean))  # a flip never keeps the letter


def test_motif_rate_and_motifs_are_alphabet_runs():
    pieces = tasks.style_pieces(random.Random(0), "left", 2, 60_000, bigram_strength=3.0, motif_prob=0.3)
    motifs = [p for p in pieces if len(p) > 1]
    assert abs(len(motifs) / len(pieces) - 0.3) < 0.01  # ~25,000 decisions
    alphabet = "".join(tasks.LETTERS)
    assert all(3 <= len(m) <= 5 and m in alphabet for m in motifs)
    assert len("".join(pieces)) == 60_000


@pytest.mark.parametrize("family,style", [("left", 0), ("right", 4)])
def test_bigram_strength_is_visible_in_transition_counts(family, style):
    """P(next | prev) is proportional to unigram(next) x (1 + 3.0) for a preferred pair: per
    previous letter, counts over unigram weight are ~4x larger on preferred next letters."""
    table = (tasks.LEFT_STYLES if family == "left" else tasks.RIGHT_STYLES)[style]
    letters = "".join(tasks.style_pieces(random.Random(0), family, style, 200_000, bigram_strength=3.0,
                                         motif_prob=0.0))
    counts = collections.Counter(zip(letters, letters[1:]))
    with_preferences = {p for p, _ in table.bigrams}  # the 8 primaries and secondaries
    assert len(with_preferences) == 8
    for prev in with_preferences:
        rate = {pref: sum(counts[prev, t] for t in tasks.LETTERS if ((prev, t) in table.bigrams) == pref)
                / sum(table.unigram[t] for t in tasks.LETTERS if ((prev, t) in table.bigrams) == pref)
                for pref in (True, False)}
        assert 3.4 < rate[True] / rate[False] < 4.7, prev


def _parse_mqar(symbols):
    sep, q = symbols.index("<sep>"), symbols.index("<q>")
    memory = [symbols[j:j + 3] for j in range(1, sep, 3)]
    return sep, q, memory


def test_mqar_lags_as_requested_and_answers_are_the_stored_values():
    span = MQAR.key_len + 1
    for split in ("test", "train"):
        lags = []
        for i in range(40):
            symbols, answers = MQAR.symbols_of(split, i)
            sep, q, memory = _parse_mqar(symbols)
            lag = q - sep - 1  # the noise block's length
            lags.append(lag)
            assert lag == MQAR.lag(split, i) and len(symbols) == MQAR.length(lag)
            if split == "test":
                assert lag == MQAR.eval_lags[i % 4]
            assert len(memory) == 4 and len({tuple(m[:2]) for m in memory}) == 4
            stored = {tuple(m[:2]): m[2] for m in memory}
            noise = [s for s in symbols[sep + 1:q] if s != "."]
            for j in range(0, len(noise), span):  # distractors: a memory prefix, another suffix
                key = tuple(noise[j:j + 2])
                assert key not in stored and any(k[0] == key[0] for k in stored)
            assert len(answers) == 3 and len({tuple(symbols[a - 2:a]) for a in answers}) == 3
            for a in answers:
                key = tuple(symbols[a - 2:a])
                assert symbols[a] == stored[key]
                source = 1 + span * list(stored).index(key) + 2  # the stored value's position
                assert lag < a - source <= lag + span * (4 + 3) + 2
            assert MQAR.example(split, i).answer.nonzero()[0].tolist() == answers
        if split == "train":
            assert min(lags) >= 4 and max(lags) <= 10 and len(set(lags)) > 4


@pytest.mark.parametrize("options,field", [
    (dict(name="symbolsoup", task=dict(bigram=3.0)), "bigram"),
    (dict(name="symbolsoup", task=dict(train_examples=30)), "train_examples"),
    (dict(name="symbolsoup", task=dict(min_tokens=700)), "min_tokens"),
    (dict(name="symbolsoup", task=dict(flip_prob=1.5)), "flip_prob"),
    (dict(name="diffuse_mqar", task=dict(queries=9)), "queries"),
    (dict(name="diffuse_mqar", task=dict(key_len=1)), "key_len"),
    (dict(name="diffuse_mqar", task=dict(lag_min=9, lag_max=3)), "lag"),
])
def test_bad_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        tasks.get_task(ml_collections.ConfigDict(options))


def test_rows_pad_with_segment_zero_and_the_loader_resumes():
    config = data_config("diffuse_mqar", **MQAR.__dict__)
    loader = tasks.train_loader(config, seed=3, batch_size=4, seq_len=48)
    first = next(loader)
    n = first["segment_ids"].sum(1)  # example lengths
    for b in range(4):
        assert (first["segment_ids"][b] == (np.arange(48) < n[b])).all()
        assert (first["positions"][b, :n[b]] == np.arange(n[b])).all()
        assert (first["tokens"][b, n[b]:] == 0).all() and first["loss_weight"][b].sum() == 3
        assert (first["loss_weight"][b] <= first["segment_ids"][b]).all() and first["loss_weight"].dtype == np.float32
    state = loader.get_state()
    expected = [next(loader) for _ in range(3)]
    again = tasks.train_loader(config, seed=3, batch_size=4, seq_len=48)
    again.set_state(json.loads(json.dumps(state)))
    for batch in expected:
        jax.tree.map(np.testing.assert_array_equal, next(again), batch)
    with pytest.raises(DataError, match="raise seq_len to at least 33"):  # 3 + 10 + 7 x 3 tokens
        tasks.train_loader(config, seed=3, batch_size=4, seq_len=30)


def test_training_loss_is_the_answer_nll(tmp_path):
    """Step 1's loss is the mean nll of the initial model on the first batch's answers only."""
    from lab.state import model_config
    from lab.training import train
    config = _task_config(tmp_path, "diffuse_mqar")
    config.train.steps = 1
    loss = train(config)["losses"][0]
    model = DecoderLM(model_config(config, tasks.tokenizer(MQAR).vocab_size), rngs=nnx.Rngs(config.seed))
    batch = next(tasks.train_loader(config.data, seed=config.seed, batch_size=config.batch_size,
                                    seq_len=config.seq_len + 1))
    logits = model(jnp.asarray(batch["tokens"][:, :-1]), positions=jnp.asarray(batch["positions"][:, :-1]),
                   segment_ids=jnp.asarray(batch["segment_ids"][:, :-1]))
    logp = np.asarray(jax.nn.log_softmax(logits))
    rows, cols = np.nonzero(batch["loss_weight"][:, 1:])
    by_hand = -np.mean(logp[rows, cols, batch["tokens"][rows, cols + 1]])
    assert len(rows) == 3 * config.batch_size
    assert loss == pytest.approx(by_hand, rel=1e-4)


def test_task_accuracy_by_hand():
    """Padded batches give the same predictions as each example alone; accuracy per lag."""
    vocab = tasks.tokenizer(MQAR).vocab_size
    model = DecoderLM(ModelConfig(vocab_size=vocab, d_model=16, num_layers=1, num_heads=2), rngs=nnx.Rngs(0))
    got = task_accuracy(model, MQAR, "test", 12, batch_size=5)
    forward = jax.jit(lambda tokens: jnp.argmax(model(tokens), -1))
    hits = collections.defaultdict(list)
    for i in range(12):
        ex = MQAR.example("test", i)
        pred = np.asarray(forward(jnp.asarray(ex.tokens[None, :-1]))[0])
        answers = ex.answer[1:].nonzero()[0]
        hits[ex.group] += (pred[answers] == ex.tokens[1:][answers]).tolist()
    assert got["by_group"] == {g: pytest.approx(np.mean(h)) for g, h in hits.items()}
    assert got["accuracy"] == pytest.approx(np.mean(sum(hits.values(), [])))
    assert got["answers"] == 36 and set(got["by_group"]) == {4, 10, 20, 40}


def _task_config(workdir, name):
    config = tiny_config(workdir, steps=4, checkpoint_every=4, log_every=2, eval_every=4)
    config.data.name = name
    if name == "symbolsoup":
        config.data.task = tasks.default_options(name)
        config.data.task.update(min_tokens=40, max_tokens=60, train_examples=200, eval_examples=40)
        config.seq_len = 60
    else:
        config.data.task = ml_collections.ConfigDict({**MQAR.__dict__, "eval_examples": 40})
        config.seq_len = 45
    return config


# A config file naming a task; every task option is then a command-line flag.
TASK_CONFIG = """
from configs import default
from data import tasks

def get_config(name):
    c = default.get_config()
    c.data.name, c.data.task = name, tasks.default_options(name)
    return c
"""


@pytest.mark.slow
def test_train_and_eval_on_each_task_from_the_command_line(tmp_path):
    (tmp_path / "task_config.py").write_text(TASK_CONFIG)
    workdirs = []
    for name in ("symbolsoup", "diffuse_mqar"):
        c = _task_config(tmp_path / name, name)
        flags = [f"--config.{k}={v}" for k, v in [
            ("workdir", c.workdir), ("model.d_model", 32), ("model.num_layers", 2), ("model.num_heads", 2),
            ("seq_len", c.seq_len), ("batch_size", 8), ("train.steps", 4), ("train.warmup_steps", 2),
            ("train.log_every", 2), ("train.eval_every", 4)]]
        flags += [f"--config.data.task.{k}={v}" for k, v in c.data.task.items()]
        run = cli("train.py", "--config", f"{tmp_path / 'task_config.py'}:{name}", *flags)
        assert run.returncode == 0, run.stderr[-2000:]
        last = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[-1])
        assert 0 <= last["val_acc"] <= 1 and np.isfinite(last["val_loss"])
        workdirs.append(c.workdir)
    run = cli("eval.py", f"--workdirs={','.join(workdirs)}", f"--out={tmp_path / 'cmp'}")
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads((tmp_path / "cmp" / "results.json").read_text())["runs"]
    assert results["symbolsoup"]["task_results"]["examples"] == 40
    assert set(results["diffuse_mqar"]["task_results"]["by_group"]) == {"4", "10", "20", "40"}
    assert "| symbolsoup | rope | symbolsoup |" in run.stdout and "| lag 40 |" in run.stdout
    assert (tmp_path / "cmp" / "tasks.png").exists()


def test_sessa_configs_hold_their_longest_examples_and_name_the_seed():
    from configs import sessa
    for task in sessa.TASKS:
        for mixer in sessa.MIXERS:
            c = sessa.get_config(f"{task}/{mixer}/1")
            assert c.seed == 1 and c.workdir == f"runs/sessa/{task}/{mixer}/seed1"
            assert c.model.mixer == mixer and c.train.steps == sessa.STEPS[task]
            if task != "lm":
                longest = max(len(tasks.get_task(c.data).example("train", i).tokens) for i in range(200))
                assert longest <= c.seq_len + 1 <= tasks.get_task(c.data).max_len("train")
    assert sessa.get_config("mqar/sessa").data.task.eval_lags[-1] == 4 * 32


@pytest.mark.parametrize("task", ["symbolsoup", "lm"])
def test_sessa_config_widths_match_parameter_counts(task):
    """The baselines' widths are the ones closest to Sessa's parameter count."""
    from configs import sessa
    from models.lm import matched_width, param_count
    from lab.state import model_config
    base = sessa.get_config(f"{task}/sessa")
    vocab = 258 if task == "lm" else tasks.tokenizer(tasks.get_task(base.data)).vocab_size
    target = param_count(model_config(base, vocab))
    for mixer in ("transformer", "mamba2"):
        cfg = model_config(sessa.get_config(f"{task}/{mixer}"), vocab)
        assert cfg.d_model == matched_width(cfg, mixer, target)
        assert abs(param_count(cfg) / target - 1) < 0.05
    assert sessa.WIDTHS["sessa_nofb"] == sessa.WIDTHS["sessa"]  # the ablation changes nothing else
    with pytest.raises(ValueError, match="TASK/MIXER"):
        sessa.get_config("symbolsoup/lstm")
