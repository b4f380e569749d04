"""Retrieval tasks (lab/retrieval.py): examples are deterministic, exactly L tokens, their anchor
needle at the depth asked and their answer readable from the prompt; the scores are 1 for an
oracle and chance for a model blind to the context; greedy decoding and teacher forcing agree
on a trained run; eval.py writes the reports. With every kind of tokenizer, the question and
answer are the tokenizer's ids of the text they spell, as it reads in a document."""

import base64
import hashlib
import json
import math
import os
import re

import jax
import numpy as np
import pytest
import sentencepiece as spm

from data.needles import TASKS, encode_completion
from data.tokenizers import ByteTokenizer, PretrainedTokenizer, SentencePieceTokenizer
from lab import retrieval
from lab.lengths import eval_impl
from lab.runs import load_run
from helpers.tiny_setup import ROOT, cli

TOKENIZER = ByteTokenizer()
# A haystack with no digits, no capitals and no question marks: no sentence of it reads like a needle.
WORDS = np.random.default_rng(0).choice(["lorem", "ipsum", "dolor", "sit", "amet", "elit", "sed", "do"], 3000)
TEXT = TOKENIZER.encode(" ".join(WORDS))


# ---- an oracle that reads the answer from the prompt, and models blind to the context -----------

KEYED = r"\nWhat is the special magic number for \w+\? The special magic number for \w+ is "
QUESTIONS = {  # each task's question, which ends the prompt
    "passkey": r"\nWhat is the pass key\? The pass key is ", "single": KEYED, "multikey": KEYED, "distractor": KEYED,
    "multivalue": r"\nWhat are all the special magic numbers for \w+\? The special magic numbers for \w+ are ",
    "variable_tracking": r"\nWhich variables equal \d+\? They are: "}


def solve(task: str, prompt: str) -> str:
    """The answer the prompt's text implies, found the way a reader would."""
    if task == "passkey":
        return re.search(r"The pass key is (\d+)\. Remember it\.", prompt)[1]
    if task == "variable_tracking":
        known, names = [re.search(r"Which variables equal (\d+)\?", prompt)[1]], []
        for name, value in re.findall(r"VAR (\w+) = (\w+)\.", prompt):
            if value in known:
                known.append(name)
                names.append(name)
        return " ".join(names)
    key = re.search(r"special magic numbers? for (\w+)\?", prompt)[1]
    values = re.findall(rf"The special magic number for {key} is (\d+)\.", prompt)
    return ", ".join(values) if task == "multivalue" else values[0]


class ByLogits:
    """A fake model with the calls `retrieval.score` makes, from a logits function
    [B, T] -> [B, T, V]; greedy decoding re-runs it on the growing sequence (no cache)."""

    def teacher_forced(self, tokens, mask):
        return tuple(map(np.asarray, retrieval.answer_scores(self.logits(tokens[:, :-1]), tokens[:, 1:], mask)))

    def greedy(self, prompts, n):
        tokens = prompts
        for _ in range(n):
            tokens = np.concatenate([tokens, self.logits(tokens)[:, -1:].argmax(-1)], 1)
        return tokens[:, -n:]


class Oracle(ByLogits):
    """All mass on the answer's tokens after the question: reads each row's question, finds the
    answer in the prompt's text (`solve`); uniform elsewhere."""

    def __init__(self, task):
        self.task = task

    def logits(self, tokens):
        out = np.zeros((*tokens.shape, TOKENIZER.vocab_size), np.float32)
        for row, ids in zip(out, tokens):
            text = bytes(np.maximum(ids - 2, 0).astype(np.uint8)).decode("latin-1")  # one character per token
            end = re.search(QUESTIONS[self.task], text).end()
            for j, token in enumerate(TOKENIZER.encode(solve(self.task, text[:end]))[:len(ids) - end + 1]):
                row[end - 1 + j] = -1e9
                row[end - 1 + j, token] = 0
        return out


class Blind(ByLogits):
    """The same logits at every position whatever the context: uniform over `tokens` (every token by default)."""

    def __init__(self, tokens=None):
        self.row = np.full(TOKENIZER.vocab_size, -1e9, np.float32)
        self.row[slice(None) if tokens is None else tokens] = 0

    def logits(self, tokens):
        return np.broadcast_to(self.row, (*tokens.shape, len(self.row)))


def examples(task, length, depths=retrieval.DEPTHS, n=2, seed=0, text=TEXT):
    return [retrieval.make_example(task, TOKENIZER, text, length, d, retrieval.example_seed(seed, task, length, d, i))
            for d in depths for i in range(n)]


# ---- the examples ------------------------------------------------------------------------------

@pytest.mark.parametrize("task", retrieval.TASKS)
@pytest.mark.parametrize("length", [400, 1000])
def test_examples_are_deterministic_exact_and_placed(task, length):
    made, again, other = examples(task, length), examples(task, length), examples(task, length, seed=1)
    for e, same, different in zip(made, again, other):
        assert np.array_equal(e.prompt, same.prompt) and np.array_equal(e.answer, same.answer)
        assert not np.array_equal(e.prompt, different.prompt)
    assert len({TOKENIZER.decode(e.answer) for e in made}) > 1  # the values are drawn, not fixed
    for depth, e in zip(np.repeat(retrieval.DEPTHS, 2), made):
        assert len(e.prompt) + len(e.answer) == length
        spans = sorted(e.needles)
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # no needle inside another
        start = e.needles[0][0]
        haystack_before = start - sum(n for s, n in e.needles if s < start)
        assert haystack_before == round(depth * e.free)  # the anchor's depth: its share of the haystack before it
        text = TOKENIZER.decode(e.prompt)
        needles = [TOKENIZER.decode(e.prompt[s:s + n]) for s, n in e.needles]
        assert all(n.startswith("\n") and n.endswith(".\n") for n in needles)
        answer = TOKENIZER.decode(e.answer)
        assert re.split(r"[ ,]+", answer)[0] in needles[0]  # the anchor holds the (first) value asked
        assert solve(task, text) == answer  # the prompt alone determines the answer
        assert re.search(QUESTIONS[task] + "$", text)
    if task in ("multivalue", "variable_tracking"):  # the needles keep their order
        assert all(e.needles == tuple(sorted(e.needles)) for e in made)


def test_byte_examples_are_pinned():
    """The byte tokenizer's examples are the same bytes as when needles, question and answer were
    encoded one by one (a byte is a byte wherever it stands): the digest of every task's examples."""
    digest = hashlib.sha256()
    for task in retrieval.TASKS:
        for length in (400, 1000):
            for e in examples(task, length):
                digest.update(e.prompt.tobytes() + e.answer.tobytes() + repr((e.needles, e.free)).encode())
    assert digest.hexdigest() == "4e0507c3afa4af673827ef2f9ff67e01abad17fb417edd3e1a05075fc945279d"


# ---- the text the ids spell, with every kind of tokenizer -------------------------------------------

HF = os.path.join(ROOT, "tests", "data", "hf", "tokenizers")
# Llama 3's pre-tokenizer pattern, which the tiktoken fixture is read with (meta-llama/llama3, llama/tokenizer.py).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.fixture(scope="module")
def project_sentencepiece(tmp_path_factory):
    """A sentencepiece model trained as the project trains one, on the haystack and the tasks' texts."""
    rng = np.random.default_rng(0)
    texts = [" ".join(WORDS)] + ["".join(needles) + question + answer
                                 for task in TASKS.values() for needles, question, answer, _ in
                                 (task(rng) for _ in range(20))]
    return SentencePieceTokenizer.train(texts, 400, str(tmp_path_factory.mktemp("spm") / "spm.model"))


def library(kind: str, project_sentencepiece):
    """(the tokenizer, text -> its ids as the tokenizer's own library encodes a document, no special token)."""
    if kind == "byte":
        return TOKENIZER, lambda text: (np.frombuffer(text.encode(), np.uint8) + 2).tolist()
    if kind == "sentencepiece":
        return project_sentencepiece, spm.SentencePieceProcessor(model_file=project_sentencepiece.model_path).encode
    tok = PretrainedTokenizer(os.path.join(HF, kind))
    if kind == "spm":
        return tok, spm.SentencePieceProcessor(model_file=os.path.join(HF, kind, "tokenizer.model")).encode
    if kind == "tiktoken":
        tiktoken = pytest.importorskip("tiktoken")
        with open(os.path.join(HF, kind, "tokenizer.model"), "rb") as f:
            ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in f)}
        return tok, tiktoken.Encoding("fixture", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                      special_tokens={}).encode_ordinary
    tokenizers = pytest.importorskip("tokenizers")
    lib = tokenizers.Tokenizer.from_file(os.path.join(HF, kind, "tokenizer.json"))
    lib.encode_special_tokens = True
    return tok, lambda text: lib.encode(text, add_special_tokens=False).ids


# kind -> whether its library puts a space ("▁") before a document's text: Llama 2's layouts.
KINDS = {"byte": False, "sentencepiece": False, "json": False, "json_llama2": True, "spm": True, "tiktoken": False}


def mid_document(kind: str, ids_of, text: str) -> list[int]:
    """The library's ids of `text` (which starts with a newline) as it reads in the middle of a document:
    its ids as a document, less the space Llama 2's tokenizers put first, which stands alone before the
    newline."""
    ids = ids_of(text)
    if KINDS[kind]:
        assert text.startswith("\n") and len(ids_of("\n")) == 2 and ids[:2] == ids_of("\n")
        return ids[1:]
    return ids


@pytest.mark.parametrize("kind", KINDS)
def test_question_answer_and_needles_are_the_ids_of_their_text(kind, project_sentencepiece):
    """For every task: the prompt's tail and the answer are the library's ids of question + answer as
    one text in the middle of a document, split where the answer's tokens begin; they decode to
    question + answer; each needle is its text's ids likewise."""
    tok, ids_of = library(kind, project_sentencepiece)
    text = tok.encode(" ".join(WORDS))
    for task in TASKS:
        seed = retrieval.example_seed(0, task, 800, 0.5, 0)
        e = retrieval.make_example(task, tok, text, 800, 0.5, seed)
        needles, question, answer, _ = TASKS[task](np.random.default_rng(seed))
        joined = mid_document(kind, ids_of, question + answer)
        asked = len(joined) - len(e.answer)
        assert e.prompt[len(e.prompt) - asked:].tolist() + e.answer.tolist() == joined
        assert tok.decode(joined) == question + answer
        assert question.startswith(tok.decode(joined[:asked]))  # the prompt spells question text only
        assert not question.startswith(tok.decode(joined[:asked + 1]))  # and ends where the answer's tokens begin
        for (start, n), needle in zip(e.needles, needles):
            assert e.prompt[start:start + n].tolist() == mid_document(kind, ids_of, needle)
            assert tok.decode(e.prompt[start:start + n]) == needle


@pytest.mark.parametrize("kind", KINDS)
def test_a_token_joined_across_the_boundary_starts_the_answer(kind, project_sentencepiece):
    """Where the tokenizer joins the prompt's trailing space to the answer's first word (" the", "▁the":
    every kind here but bytes), the joined token starts the answer: the prompt ends where the answer's
    tokens begin, and the answer spells " the key" (Llama 2's decoders drop a text's leading space)."""
    tok, ids_of = library(kind, project_sentencepiece)
    prompt, answer = encode_completion(tok, "\nWhat is it? It is ", "the key")
    assert prompt.dtype == answer.dtype == np.int32
    assert prompt.tolist() + answer.tolist() == mid_document(kind, ids_of, "\nWhat is it? It is the key")
    assert tok.decode(prompt) == "\nWhat is it? It is" + (" " if kind == "byte" else "")
    assert tok.decode(answer) == ("the key" if kind == "byte" or KINDS[kind] else " the key")


def test_depth_zero_and_one_put_the_needle_first_and_last():
    first, last = examples("passkey", 300, depths=(0.0, 1.0), n=1)
    assert first.needles[0][0] == 0
    start, n = last.needles[0]
    question = TOKENIZER.encode("\nWhat is the pass key? The pass key is ")
    assert start + n + len(question) == len(last.prompt)


def test_a_length_too_short_for_the_task_makes_no_example():
    assert examples("passkey", 81, n=1, depths=(0.5,)) != [None]  # needle 37 + question 39 + answer 5
    assert examples("passkey", 80, n=1, depths=(0.5,)) == [None]
    assert examples("multikey", 200, n=1, depths=(0.5,)) == [None]


# ---- the scores -----------------------------------------------------------------------------------

@pytest.mark.parametrize("task", retrieval.TASKS)
def test_an_oracle_scores_one_and_a_blind_model_chance(task):
    """Five examples in rows of 3 (the last call padded). Chance, for a model whose logits ignore
    the context: uniform over the vocabulary gives answer log-probability -log V and exact match 0
    (the argmax is token 0, PAD, in no answer); uniform over the ten digits gives -log 10 on an
    all-digit answer, and exact match 0 (the argmax '0' starts no value)."""
    made = examples(task, 400, depths=(0.0, 0.5, 1.0))[:5]
    oracle = retrieval.score(Oracle(task), made, rows=3, decode=True)
    assert [(r["exact"], r["decoded"]) for r in oracle] == [(True, True)] * 5
    assert np.allclose([r["logprob"] for r in oracle], 0.0, atol=1e-6)
    assert all(r["generated"] == r["predicted"] == e.answer.tolist() for r, e in zip(oracle, made))
    blind = retrieval.score(Blind(), made, rows=3, decode=True)
    assert not any(r["exact"] or r["decoded"] for r in blind)
    assert np.allclose([r["logprob"] for r in blind], -math.log(TOKENIZER.vocab_size), atol=1e-5)
    if task in ("passkey", "single", "multikey", "distractor"):
        digits = retrieval.score(Blind(TOKENIZER.encode("0123456789")), made, rows=3, decode=True)
        assert not any(r["exact"] or r["decoded"] for r in digits)
        assert np.allclose([r["logprob"] for r in digits], -math.log(10), atol=1e-5)


def test_decoding_and_teacher_forcing_agree_on_a_trained_run(tiny_run):
    """On the 12-step run, greedy decoding through the KV cache (models.lm.generate) and the
    teacher-forced argmax of the parallel forward agree token by token, as they must: both
    predict the first answer token from the prompt alone, and they match the answer for exactly
    as long as each other (the accuracies, both 0 at 12 steps, say little by themselves). Then
    the answers are replaced by what the model decoded: teacher forcing must score every one an
    exact match, which a misaligned answer position or a decode path that differs from the
    parallel forward would break. The prompts (123 tokens) are prefilled 48 tokens at a time."""
    config, _ = tiny_run
    _, model, _ = load_run(config.workdir)
    length = 128
    made = examples("passkey", length, depths=(0.0, 0.5, 1.0))
    scorer = retrieval.ModelScorer(model, eval_impl(config.model.attention_impl, length, config.eval.blockwise_from),
                                   jax.random.key(0), prefill_chunk=48)
    records = retrieval.score(scorer, made, rows=4, decode=True)

    def matched(tokens, answer):
        return next((j for j, (a, b) in enumerate(zip(tokens, answer)) if a != b), len(answer))

    for r, e in zip(records, made):
        assert r["generated"][0] == r["predicted"][0]
        assert matched(r["generated"], e.answer) == matched(r["predicted"], e.answer)
        assert r["decoded"] == r["exact"]
    own = [retrieval.Example(e.prompt, np.asarray(r["generated"], np.int32), e.needles, e.free)
           for e, r in zip(made, records)]
    assert all(r["exact"] for r in retrieval.score(scorer, own, rows=4, decode=False))


def test_bad_options_are_one_line():
    for options, error in [
        (dict(tasks="passkey,nope"), "retrieval option tasks=passkey,nope: unknown nope; valid: one or more of passkey,"),
        (dict(tasks=[]), "retrieval option tasks is empty; valid: one or more of passkey,"),
        (dict(depths=[0.5, 1.5]), "retrieval option depths=1.5 is above 1.0; valid: a number in [0.0, 1.0]"),
        (dict(examples=0), "retrieval option examples=0 is below 1"),
        (dict(lengths=["64", "x"]), "retrieval option lengths=x is not an integer"),
    ]:
        given = dict(tasks=None, lengths=None, depths=retrieval.DEPTHS, examples=4, seed=0, decode_max_length=None)
        with pytest.raises(ValueError) as raised:
            retrieval.checked_options(**{**given, **options})
        assert str(raised.value).startswith(error) and "\n" not in str(raised.value)


def test_eval_py_writes_the_retrieval_reports(tiny_run, tmp_path):
    """The run's eval lengths 16 ... 128: passkey fits only 128, scored at depths 0 and 1, and
    decoded there (every length by default, the prompt prefilled eval.blockwise_from = 128 tokens at a
    time)."""
    config, _ = tiny_run
    run = cli("eval.py", f"--workdirs={config.workdir}", f"--out={tmp_path}", "--evals=retrieval",
              "--retrieval_tasks=passkey", "--retrieval_depths=0,1", "--retrieval_examples=1")
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.load(open(tmp_path / "retrieval.json"))
    assert results["lengths"] == [16, 32, 64, 128] and results["depths"] == [0.0, 1.0]
    assert results["decode_max_length"] is None and results["runs"]["rope"]["prefill_chunk"] == 128
    passkey = results["runs"]["rope"]["tasks"]["passkey"]
    assert sorted(passkey["skipped"]) == ["16", "32", "64"]
    assert [(c["length"], c["depth"], c["examples"]) for c in passkey["cells"]] == [(128, 0.0, 1), (128, 1.0, 1)]
    assert all(c["decode_accuracy"] is not None for c in passkey["cells"])
    assert all(len(r["generated"]) == len(r["answer"]) == 5 for r in passkey["records"])
    assert retrieval.summary(results) == {"accuracy": np.mean([r["exact"] for r in passkey["records"]]),
                                          "accuracy_longest": np.mean([r["exact"] for r in passkey["records"]]),
                                          "logprob": pytest.approx(np.mean([c["logprob"] for c in passkey["cells"]]))}
    assert "| rope | rope | - | - | - | " in run.stdout
    assert (tmp_path / "retrieval.md").read_text() in run.stdout
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["retrieval.png", "retrieval_heatmaps.png"]
