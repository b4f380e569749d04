"""data/tokenizers.py: byte and sentencepiece round trips, ids, caching, names; a pretrained model's
own tokenizer (tokenizer.json, sentencepiece, tiktoken): its library's ids, special ids, BOS, bad files;
text encoded as a continuation (no prefix space) for every kind."""

from __future__ import annotations

import base64
import json
import os
import shutil
import sys

import numpy as np
import pytest
import sentencepiece as spm

from data import DataError, local_text, pipeline
from data.tokenizers import (ByteTokenizer, PretrainedTokenizer, SentencePieceTokenizer, encode_document,
                             get_tokenizer)

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "class A:\n\tpass  # naïve größe 日本語\n",
    "  two leading spaces,   three inside, trailing  \n\n\n",
    "emoji 🎉 and cyrillic ж",
    "",
]


def test_byte_round_trip_and_ids():
    tok = ByteTokenizer()
    assert (tok.pad_id, tok.eos_id, tok.vocab_size) == (0, 1, 258)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and ids.ndim == 1
        assert len(ids) == len(text.encode("utf-8"))
        assert ids.size == 0 or (ids.min() >= 2 and ids.max() < 258)
        assert tok.decode(ids) == text
    np.testing.assert_array_equal(tok.encode("A\x00\xff".encode("latin-1")), [ord("A") + 2, 2, 257])


def test_byte_decode_skips_pad_eos_and_replaces_invalid_utf8():
    tok = ByteTokenizer()
    ids = np.concatenate([tok.encode("hé"), [tok.eos_id, tok.pad_id, tok.pad_id]])
    assert tok.decode(ids) == "hé"
    assert tok.decode(tok.encode(b"a\xffb")) == "a\ufffdb"


def test_sentencepiece_trains_and_round_trips(tmp_path):
    model_path = str(tmp_path / "sub" / "spm.model")
    tok = SentencePieceTokenizer.train(TEXTS * 10, vocab_size=400, model_path=model_path)
    assert os.path.exists(model_path)
    assert (tok.pad_id, tok.eos_id) == (0, 1)
    assert 300 < tok.vocab_size <= 400  # 256 byte pieces + PAD, EOS, UNK, then learned pieces
    unseen = "unseen characters: ∮ λ ⊕ and tabs\t\tnewlines\n"
    for text in TEXTS + [unseen]:
        ids = tok.encode(text)
        assert ids.dtype == np.int32
        assert ids.size == 0 or ids.min() > tok.eos_id  # no PAD/EOS inside a text
        assert tok.decode(ids) == text
        assert tok.decode(np.concatenate([ids, [tok.eos_id, tok.pad_id]])) == text
        np.testing.assert_array_equal(tok.encode(text, continuation=True), ids)  # trained without a dummy prefix
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0])  # it learned pieces longer than a byte
    reloaded = SentencePieceTokenizer(model_path)
    np.testing.assert_array_equal(reloaded.encode(TEXTS[1]), tok.encode(TEXTS[1]))


def test_get_tokenizer_caches_sentencepiece(tmp_path):
    assert isinstance(get_tokenizer("byte", str(tmp_path)), ByteTokenizer)
    tok = get_tokenizer(
        "sentencepiece", str(tmp_path), corpus_id="c/1", train_texts=lambda: TEXTS * 10, vocab_size=300
    )
    assert os.listdir(tmp_path / "tokenizers") == ["spm-c_1-300.model"]

    def must_not_train():
        raise AssertionError("the cached model should be used")

    again = get_tokenizer(
        "sentencepiece", str(tmp_path), corpus_id="c/1", train_texts=must_not_train, vocab_size=300
    )
    np.testing.assert_array_equal(again.encode(TEXTS[0]), tok.encode(TEXTS[0]))


def test_get_tokenizer_unknown_name_lists_valid_names(tmp_path):
    with pytest.raises(ValueError, match="byte, sentencepiece"):
        get_tokenizer("wordpiece", str(tmp_path))


# ---- a pretrained model's own tokenizer (tests/data/hf/make_tokenizers.py writes the fixtures) ----

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "hf", "tokenizers")
# Llama 3's pre-tokenizer pattern, which tiktoken files are read with (meta-llama/llama3, llama/tokenizer.py).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
UNSEEN = TEXTS + ["unseen characters: ∮ λ ⊕ and tabs\t\tnewlines\n",
                  "<|end_of_text|> <s></s> spell special tokens",
                  "x = {'naïve': [1, 2], \"größe\": None}\n\n    # 日本語 🎉\r\n"]


def fixture(name: str, file: str = "") -> str:
    return os.path.join(FIXTURES, name, file)


def library_ids(name: str):
    """text -> ids, as the fixture's own library encodes it, called directly (no special tokens)."""
    if name.startswith("json"):
        tokenizers = pytest.importorskip("tokenizers")
        tok = tokenizers.Tokenizer.from_file(fixture(name, "tokenizer.json"))
        tok.encode_special_tokens = True  # a text that spells a special token is text (tiktoken's encode_ordinary)
        return lambda text: tok.encode(text, add_special_tokens=False).ids
    if name == "spm":
        return spm.SentencePieceProcessor(model_file=fixture("spm", "tokenizer.model")).encode
    tiktoken = pytest.importorskip("tiktoken")
    with open(fixture("tiktoken", "tokenizer.model"), "rb") as f:
        ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in f)}
    encoding = tiktoken.Encoding("fixture", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens={})
    return encoding.encode_ordinary


@pytest.mark.parametrize("name", ["json", "json_llama2", "spm", "tiktoken"])
def test_pretrained_ids_are_the_librarys_and_round_trip(name):
    ids_of = library_ids(name)
    tok = PretrainedTokenizer(fixture(name))
    for text in UNSEEN:
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and ids.ndim == 1
        np.testing.assert_array_equal(ids, ids_of(text))
        assert tok.decode(ids) == text
        assert tok.decode(np.concatenate([[tok.bos_id], ids, [tok.eos_id, tok.pad_id, tok.vocab_size + 5]])) == text
        assert not {tok.bos_id, tok.eos_id} & set(ids.tolist())  # not even from "<|end_of_text|> <s></s>"
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0].encode())  # pieces longer than a byte
    assert tok.encode(TEXTS[1].encode("utf-8")).tolist() == tok.encode(TEXTS[1]).tolist()  # corpus records are bytes


# Texts that follow a document's first line, "The pass key\n": no fixture merges a token across that newline
# (Llama 3's pattern splits it off; Llama 2's fixtures have it as the byte piece <0x0A>, in no merge).
FOLLOWING = ["a", " a", "71432", "The pass key is 71432. Remember it.", "  two leading spaces, tabs\t\t",
             "VAR KQZTW = 12345.", "naïve 日本語 🎉"]


@pytest.mark.parametrize("name,prefix", [("json", False), ("json_llama2", True), ("spm", True), ("tiktoken", False)])
def test_a_continuation_is_the_text_as_the_library_reads_it_after_other_text(name, prefix):
    """encode(text, continuation=True) is what the library's ids of a whole document give the text after its first
    line. Llama 2's layouts (sentencepiece's dummy prefix, a tokenizer.json's Prepend("▁")) read a text alone with a
    space before it (encode("a") is "▁a"), which a continuation has not; byte-level BPEs (Llama 3's) prefix none."""
    ids_of, tok = library_ids(name), PretrainedTokenizer(fixture(name))
    first = ids_of("The pass key\n")
    for text in FOLLOWING:
        following = tok.encode(text, continuation=True)
        assert following.dtype == np.int32
        assert ids_of("The pass key\n" + text) == first + following.tolist()
        assert tok.decode(first + following.tolist()) == "The pass key\n" + text  # alone: " a" decodes as "a"
        assert (tok.encode(text).tolist() != following.tolist()) == prefix
    assert tok.encode("a", continuation=True).tolist() == (ids_of("a")[1:] if prefix else ids_of("a"))


@pytest.mark.parametrize("layout", ["metaspace", "metaspace_legacy", "byte_level_prefix"])
def test_a_continuation_drops_the_prefix_space_of_every_tokenizer_json_layout(tmp_path, layout):
    """The other layouts that prefix a space: Metaspace pre-tokenizers (newer Llama 2 / Mistral conversions:
    prepend_scheme 'first', no split; older files: add_prefix_space) in place of the fixture's Prepend normalizer,
    and a byte-level pre-tokenizer with add_prefix_space (GPT-2's pattern, as RoBERTa's)."""
    tokenizers = pytest.importorskip("tokenizers")
    folder = copy_fixture("json" if layout == "byte_level_prefix" else "json_llama2", tmp_path)
    with open(os.path.join(folder, "tokenizer.json")) as f:
        content = json.load(f)
    content["normalizer"], content["pre_tokenizer"] = None, {
        "metaspace": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False},
        "metaspace_legacy": {"type": "Metaspace", "replacement": "▁", "add_prefix_space": True},
        "byte_level_prefix": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    }[layout]
    write_json(folder, "tokenizer.json", content)
    lib = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    ids_of = lambda text: lib.encode(text, add_special_tokens=False).ids  # noqa: E731
    tok = PretrainedTokenizer(folder)
    assert ids_of("a") != tok.encode("a", continuation=True).tolist()  # a prefix space, which a continuation drops
    first = ids_of("The pass key\n")
    for text in FOLLOWING:
        assert ids_of("The pass key\n" + text) == first + tok.encode(text, continuation=True).tolist()
        assert tok.encode(text).tolist() == ids_of(text)


def test_the_tiktoken_file_is_the_json_tokenizers_bpe():
    """The tiktoken fixture holds the tokenizer.json fixture's BPE (as Llama 3's original tokenizer.model
    holds its tokenizer.json's): the same ids for every text, and the same special ids after the ranks."""
    json_ids, tiktoken_ids = library_ids("json"), library_ids("tiktoken")
    for text in UNSEEN:
        assert json_ids(text) == tiktoken_ids(text)
    a, b = PretrainedTokenizer(fixture("json")), PretrainedTokenizer(fixture("tiktoken"))
    assert (a.bos_id, a.eos_id) == (b.bos_id, b.eos_id)


def test_special_ids_and_bos_of_a_tokenizer_json_laid_out_as_llama3s():
    tokenizers = pytest.importorskip("tokenizers")
    lib = tokenizers.Tokenizer.from_file(fixture("json", "tokenizer.json"))
    tok = PretrainedTokenizer(fixture("json"))  # tokenizer_config.json names bos and eos; no pad
    bos, eos = lib.token_to_id("<|begin_of_text|>"), lib.token_to_id("<|end_of_text|>")
    assert (tok.kind, tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == ("tokenizers", bos, eos, eos, True)
    assert tok.vocab_size == lib.get_vocab_size() == 302
    assert lib.encode("a").ids[0] == bos  # its post-processor prepends BOS, which encode leaves to the pipeline
    np.testing.assert_array_equal(encode_document(tok, "a b"), [bos, *lib.encode("a b", add_special_tokens=False).ids,
                                                                eos])


def test_special_ids_and_bos_of_a_sentencepiece_model_laid_out_as_llama2s():
    sp = spm.SentencePieceProcessor(model_file=fixture("spm", "tokenizer.model"))
    tok = PretrainedTokenizer(fixture("spm"))  # special_tokens_map.json; generation_config.json's pad_token_id 0
    assert (tok.kind, tok.vocab_size) == ("sentencepiece", sp.get_piece_size())
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (sp.piece_to_id("<s>"), sp.piece_to_id("</s>"),
                                                                 sp.piece_to_id("<unk>"), True)
    np.testing.assert_array_equal(encode_document(tok, "a b"), [sp.piece_to_id("<s>"), *sp.encode("a b"),
                                                                sp.piece_to_id("</s>")])
    byte = ByteTokenizer()
    np.testing.assert_array_equal(encode_document(byte, "é"), [*byte.encode("é"), byte.eos_id])  # no BOS


def test_special_ids_and_bos_of_a_tiktoken_file_alone_are_llama3s():
    pytest.importorskip("tiktoken")
    with open(fixture("tiktoken", "tokenizer.model")) as f:
        ranks = len(f.readlines())
    tok = PretrainedTokenizer(fixture("tiktoken", "tokenizer.model"))  # no other file: Llama 3's 256 after the ranks
    assert (tok.kind, tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (
        "tiktoken", ranks + 256, ranks, ranks + 1, ranks + 1, True)


def copy_fixture(name: str, tmp_path) -> str:
    target = str(tmp_path / name)
    shutil.copytree(fixture(name), target)
    return target


def write_json(folder: str, file: str, content) -> None:
    with open(os.path.join(folder, file), "w") as f:
        json.dump(content, f)


def test_special_tokens_come_from_the_first_file_that_names_them(tmp_path):
    """tokenizer_config.json, then special_tokens_map.json, generation_config.json (a list: its first) and
    config.json; then the tokenizer's own. add_bos_token in tokenizer_config.json decides BOS."""
    tokenizers = pytest.importorskip("tokenizers")
    lib = tokenizers.Tokenizer.from_file(fixture("json", "tokenizer.json"))
    folder = copy_fixture("json", tmp_path)
    ids = lambda: (lambda t: (t.bos_id, t.eos_id, t.pad_id, t.add_bos))(PretrainedTokenizer(folder))  # noqa: E731
    the = lib.token_to_id
    write_json(folder, "config.json", {"bos_token_id": 5, "eos_token_id": 6, "pad_token_id": 7})
    write_json(folder, "generation_config.json", {"eos_token_id": [8, 9], "pad_token_id": None})
    write_json(folder, "special_tokens_map.json", {"pad_token": {"content": "The", "special": False}})
    assert ids() == (the("<|begin_of_text|>"), the("<|end_of_text|>"), the("The"), True)
    os.remove(os.path.join(folder, "special_tokens_map.json"))
    write_json(folder, "tokenizer_config.json", {"eos_token": "<|begin_of_text|>", "add_bos_token": False})
    assert ids() == (5, the("<|begin_of_text|>"), 7, False)
    os.remove(os.path.join(folder, "tokenizer_config.json"))
    assert ids() == (5, 8, 7, True)  # BOS as the post-processor prepends it
    for file in ("config.json", "generation_config.json"):
        os.remove(os.path.join(folder, file))
    with open(os.path.join(folder, "tokenizer.json")) as f:
        content = json.load(f)
    content["post_processor"] = None  # as Qwen2's: no BOS
    write_json(folder, "tokenizer.json", content)
    write_json(folder, "tokenizer_config.json", {"eos_token": "<|end_of_text|>"})
    assert ids() == (None, the("<|end_of_text|>"), the("<|end_of_text|>"), False)
    os.remove(os.path.join(folder, "tokenizer_config.json"))  # nothing names an EOS, which documents end in
    with pytest.raises(DataError) as error:
        PretrainedTokenizer(folder)
    assert one_line(error).startswith(f"{folder}/tokenizer.json: the model has no EOS token (no eos_token or "
                                      "eos_token_id in any of tokenizer_config.json, special_tokens_map.json, "
                                      "generation_config.json, config.json beside it, none in the tokenizer)")


def test_a_tiktoken_file_takes_its_special_tokens_from_tokenizer_config(tmp_path):
    pytest.importorskip("tiktoken")
    folder = copy_fixture("tiktoken", tmp_path)
    os.rename(os.path.join(folder, "tokenizer.model"), os.path.join(folder, "bpe.tiktoken"))  # found by suffix too
    write_json(folder, "tokenizer_config.json", {"added_tokens_decoder": {"300": {"content": "<|endoftext|>"},
                                                                          "301": {"content": "<|im_end|>"}},
                                                 "eos_token": "<|im_end|>"})
    tok = PretrainedTokenizer(folder)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (302, None, 301, 301, False)
    assert tok.decode([300, *tok.encode("ab"), 301]) == "ab"


def one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("file,content,why", [
    ("tokenizer.json", b"{not json", "is not a tokenizer.json the tokenizers library reads"),
    ("tokenizer.model", b"\x0a\xff\xff garbage", "is neither a sentencepiece model nor a tiktoken BPE-ranks file"),
    ("bpe.tiktoken", b"IQ== 0\nIg== 1\nnot base64!\n", ": line 3 is not '<base64 token> <rank>'")])
def test_a_tokenizer_file_that_does_not_parse_is_one_line_naming_it(tmp_path, file, content, why):
    if file == "tokenizer.json":
        pytest.importorskip("tokenizers")
    (tmp_path / file).write_bytes(content)
    with pytest.raises(DataError) as error:
        PretrainedTokenizer(str(tmp_path))
    assert one_line(error).startswith(f"{tmp_path / file} {why}".replace(" :", ":"))


def test_bad_special_tokens_and_paths_are_one_line_naming_the_file_and_field(tmp_path):
    folder = copy_fixture("spm", tmp_path)
    write_json(folder, "special_tokens_map.json", {"eos_token": "<|eot_id|>"})
    with pytest.raises(DataError) as error:
        PretrainedTokenizer(folder)
    assert one_line(error) == (f"{folder}/special_tokens_map.json: eos_token '<|eot_id|>' is not a token of "
                               f"{folder}/tokenizer.model; correct it or remove it")
    os.remove(os.path.join(folder, "special_tokens_map.json"))
    write_json(folder, "generation_config.json", {"pad_token_id": 320})
    with pytest.raises(DataError) as error:
        PretrainedTokenizer(folder)
    assert one_line(error).startswith(f"{folder}/generation_config.json: pad_token_id=320 is not a token id of "
                                      f"{folder}/tokenizer.model (0 to 319)")
    write_json(folder, "config.json", [])
    with pytest.raises(DataError, match=r"config\.json holds a JSON list, not an object"):
        PretrainedTokenizer(folder)
    (tmp_path / "empty").mkdir()
    for path, why in [(tmp_path / "empty", "has no tokenizer.json, tokenizer.model or *.tiktoken file"),
                      (tmp_path / "nowhere", "does not exist")]:
        with pytest.raises(DataError) as error:
            PretrainedTokenizer(str(path))
        assert one_line(error).startswith(f"tokenizer path {path} {why}; ")
    with pytest.raises(DataError, match="set data.tokenizer_path to its checkpoint directory or tokenizer file"):
        get_tokenizer("hf", str(tmp_path))


@pytest.mark.parametrize("package,name", [("tokenizers", "json"), ("tiktoken", "tiktoken")])
def test_a_missing_library_is_one_line_with_the_pip_command(monkeypatch, package, name):
    monkeypatch.setitem(sys.modules, package, None)  # `import package` now raises ImportError
    with pytest.raises(DataError) as error:
        PretrainedTokenizer(fixture(name))
    assert one_line(error) == (f"reading {fixture(name, 'tokenizer.' + ('json' if name == 'json' else 'model'))} "
                               f"needs the {package} package, which is not installed: pip install {package} (or pip "
                               "install -e '.[hf]' for every pretrained tokenizer format)")


def test_documents_start_with_bos_where_the_model_expects_it(corpus_config):
    """The pipeline's documents with a pretrained tokenizer (Llama 2's layout): <s>, the library's ids of the
    text, </s>; the same in the training documents and the eval stream."""
    sp = spm.SentencePieceProcessor(model_file=fixture("spm", "tokenizer.model"))
    config = corpus_config.copy_and_resolve_references()
    config.update(tokenizer="hf", tokenizer_path=fixture("spm"))
    source = local_text.open_split(config, "validation")
    first = min(range(len(source.records)), key=lambda i: source.records[i]["path"])
    text = source.records[first]["text"].decode("utf-8")
    doc = next(pipeline.eval_documents(config, "validation"))
    np.testing.assert_array_equal(doc, [sp.piece_to_id("<s>"), *sp.encode(text), sp.piece_to_id("</s>")])
    assert pipeline.documents(config, "validation")[first].tolist() == doc.tolist()
