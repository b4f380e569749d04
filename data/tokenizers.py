"""Tokenizers: bytes (default, nothing to train), sentencepiece (trained on a train split), and a
pretrained model's own (tokenizer.json, a sentencepiece tokenizer.model, a tiktoken BPE-ranks file).

All share one interface: `encode(text, continuation=False) -> int32[n]` (no special token added;
with `continuation`, the ids of the text where it follows other text, as in the middle of a
document: without the space that Llama 2's tokenizers put before a text), `decode(ids) -> str`
(special tokens skipped), and the attributes `pad_id`, `eos_id`, `bos_id` (None where there is
none), `add_bos` (whether a document starts with BOS: `encode_document`) and `vocab_size`. The
byte and trained sentencepiece tokenizers have PAD = 0, EOS = 1 and no BOS; a pretrained one has
its model's ids.
"""

from __future__ import annotations

import base64
import glob
import io
import itertools
import json
import os
import re
import tempfile
from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np
import sentencepiece as spm

from data import DataError, absent_dirs, remove_empty_dirs

PAD_ID = 0
EOS_ID = 1


def _as_bytes(text: str | bytes) -> bytes:
    return text.encode("utf-8") if isinstance(text, str) else bytes(text)


def _as_str(text: str | bytes) -> str:
    # Some source files are not UTF-8 (the standard library tests its own decoders on them).
    return text if isinstance(text, str) else bytes(text).decode("utf-8", errors="replace")


class ByteTokenizer:
    """UTF-8 bytes: byte b -> id b + 2, after PAD = 0 and EOS = 1. Exact for any bytes."""

    pad_id = PAD_ID
    eos_id = EOS_ID
    bos_id = None
    add_bos = False
    vocab_size = 256 + 2

    def encode(self, text: str | bytes, continuation: bool = False) -> np.ndarray:
        """Returns int32[len(utf-8 bytes of text)]: the same bytes wherever the text stands (`continuation`)."""
        return np.frombuffer(_as_bytes(text), dtype=np.uint8).astype(np.int32) + 2

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return (ids[ids >= 2] - 2).astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A sentencepiece model with PAD = 0, EOS = 1, UNK = 2, no BOS, and byte fallback.

    Trained with identity normalisation and whitespace kept as is, so encode/decode round
    trips any UTF-8 text, code indentation included (characters outside the vocabulary go
    through byte pieces).
    """

    pad_id = PAD_ID
    eos_id = EOS_ID
    bos_id = None
    add_bos = False

    def __init__(self, model_path: str):
        self.model_path = model_path
        self._processor = spm.SentencePieceProcessor(model_file=model_path)
        self.vocab_size = self._processor.get_piece_size()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, model_path: str) -> SentencePieceTokenizer:
        """Trains on `texts` (documents) and writes the model to `model_path` atomically.

        Documents are fed line by line: sentencepiece drops "sentences" longer than
        `max_sentence_length`, and whole files usually are.
        """
        sentences = (line for text in texts for line in _as_str(text).splitlines() if line.strip())
        first = next(sentences, None)
        if first is None:  # sentencepiece would fail with "INTERNAL: ... [!sentences_.empty()]"
            raise DataError(
                "No text to train the sentencepiece tokenizer on: its train texts have no non-blank line. "
                "Use a corpus with text in it, or data.tokenizer='byte'."
            )
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=itertools.chain([first], sentences),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="unigram",
            character_coverage=0.9995,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            unk_id=2,
            bos_id=-1,
            # Small corpora (tests) cannot fill a large vocabulary; train what they support.
            hard_vocab_limit=False,
            input_sentence_size=2_000_000,
            shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
        _write_atomically(model_path, model.getvalue())
        return cls(model_path)

    def encode(self, text: str | bytes, continuation: bool = False) -> np.ndarray:
        """Returns int32[n] piece ids. Trained without a dummy prefix, so `continuation` changes nothing."""
        return np.asarray(self._processor.encode(_as_str(text)), dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1) if i not in (PAD_ID, EOS_ID)]
        return self._processor.decode(ids)


# Where a pretrained model names its special tokens, in the order they are looked up: the first file
# beside the tokenizer that names one gives it. The first two name tokens (eos_token: "</s>"), the
# others ids (eos_token_id: 2, or a list whose first is taken).
SPECIAL_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "config.json")
# Llama 3's pre-tokenizer pattern and special tokens (meta-llama/llama3, llama/tokenizer.py): a tiktoken
# BPE-ranks file holds neither, so it is read with these; the 256 special tokens follow the ranks.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", *(f"<|reserved_special_token_{i}|>" for i in range(4)),
                  "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>",
                  *(f"<|reserved_special_token_{i}|>" for i in range(5, 251)))


class Backend(NamedTuple):
    """A tokenizer file as its library reads it."""
    encode: Callable[[str], list[int]]  # the text's ids, no special token added or read from the text
    continuation: Callable[[str], list[int]]  # the same for text that follows other text (no prefix space)
    decode: Callable[[list[int]], str]
    vocab_size: int  # the largest id + 1
    token_id: Callable[[str], int | None]  # a token's id, None if the tokenizer has no such token
    own: dict[str, int]  # the special tokens ('bos', 'eos', 'pad') the file itself defines
    add_bos: bool  # whether the file's own pipeline prepends BOS
    skip: frozenset  # ids decode must skip that the library would not (tiktoken's special tokens)


def _missing(path: str, package: str) -> DataError:
    return DataError(f"reading {path} needs the {package} package, which is not installed: pip install {package} "
                     "(or pip install -e '.[hf]' for every pretrained tokenizer format)")


def _without_prefix_space(step: dict | None) -> dict | None:
    """A tokenizer.json normalizer or pre-tokenizer (its JSON) as it treats text that follows other text:
    without a Prepend (Llama 2's and Mistral 7B v0.1's "▁"), with Metaspace's prepend_scheme 'never'
    (newer conversions of both have 'first', older files add_prefix_space) and ByteLevel's
    add_prefix_space off (GPT-2-style files that set it)."""
    kind = (step or {}).get("type")
    if kind == "Prepend":
        return None
    if kind == "Sequence":
        key = "normalizers" if "normalizers" in step else "pretokenizers"
        return {**step, key: [s for s in map(_without_prefix_space, step[key]) if s is not None]}
    if kind == "Metaspace":
        return {**{k: v for k, v in step.items() if k != "add_prefix_space"}, "prepend_scheme": "never"}
    if kind == "ByteLevel":
        return {**step, "add_prefix_space": False}
    return step


def _tokenizers_backend(path: str, files: dict) -> Backend:
    try:
        import tokenizers
    except ImportError:
        raise _missing(path, "tokenizers") from None
    try:
        tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception for a file it cannot read
        raise DataError(f"{path} is not a tokenizer.json the tokenizers library reads ({e}); restore it from the "
                        "checkpoint") from None
    tok.encode_special_tokens = True  # special tokens come from the pipeline, never from the text
    plain, full = tok.encode("a", add_special_tokens=False).ids, tok.encode("a").ids
    prepended = full[0] if len(full) > len(plain) and full[1:len(plain) + 1] == plain else None
    content = json.loads(tok.to_str())
    steps = {key: _without_prefix_space(content[key]) for key in ("normalizer", "pre_tokenizer")}
    following = tok
    if any(steps[key] != content[key] for key in steps):
        following = tokenizers.Tokenizer.from_str(json.dumps({**content, **steps}))
        following.encode_special_tokens = True
    return Backend(lambda text: tok.encode(text, add_special_tokens=False).ids,
                   lambda text: following.encode(text, add_special_tokens=False).ids,
                   lambda ids: tok.decode(ids, skip_special_tokens=True),
                   max(tok.get_vocab(with_added_tokens=True).values()) + 1, tok.token_to_id,
                   {} if prepended is None else {"bos": prepended}, prepended is not None, frozenset())


# A sentencepiece ModelProto field, normalizer_spec (field 3, length-delimited: wire type 2) of 2 bytes that
# set its add_dummy_prefix (field 3, varint: wire type 0) to false. Appended to a serialized model, it is
# merged into the model's own normalizer_spec, the later value winning (protobuf's rule for a field that
# occurs twice), with no protobuf package (sentencepiece_model_pb2 needs the one it was generated for).
NO_DUMMY_PREFIX = bytes([3 << 3 | 2, 2, 3 << 3 | 0, 0])


def _sentencepiece_backend(path: str, files: dict) -> Backend:
    try:
        sp = spm.SentencePieceProcessor(model_file=path)
    except RuntimeError as e:
        raise DataError(f"{path} is neither a sentencepiece model nor a tiktoken BPE-ranks file ({e}); restore it "
                        "from the checkpoint") from None
    own = {name: i for name, i in (("bos", sp.bos_id()), ("eos", sp.eos_id()), ("pad", sp.pad_id())) if i >= 0}
    following = spm.SentencePieceProcessor(model_proto=sp.serialized_model_proto() + NO_DUMMY_PREFIX)
    return Backend(sp.encode, following.encode, sp.decode, sp.get_piece_size(),
                   lambda token: i if sp.id_to_piece(i := sp.piece_to_id(token)) == token else None,
                   own, "bos" in own, frozenset())


def _tiktoken_backend(path: str, files: dict) -> Backend:
    ranks = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise DataError(f"{path}: line {number} is not '<base64 token> <rank>', as every line of a tiktoken "
                                "BPE-ranks file is; restore it from the checkpoint") from None
    try:
        import tiktoken
    except ImportError:
        raise _missing(path, "tiktoken") from None
    added = files.get("tokenizer_config.json", {}).get("added_tokens_decoder")
    special = ({token["content"]: int(i) for i, token in added.items()} if added
               else {token: len(ranks) + i for i, token in enumerate(LLAMA3_SPECIAL)})
    enc = tiktoken.Encoding(os.path.basename(path), pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                            special_tokens=special)
    own = {name: special[token] for name, token in (("bos", "<|begin_of_text|>"), ("eos", "<|end_of_text|>"))
           if token in special}
    return Backend(enc.encode_ordinary, enc.encode_ordinary, enc.decode, enc.max_token_value + 1,
                   lambda token: special.get(token, ranks.get(token.encode("utf-8"))), own, "bos" in own,
                   frozenset(special.values()))


def find_tokenizer(path: str) -> str | None:
    """The tokenizer file of `path`: `path` itself if it is a file, else the first of tokenizer.json,
    tokenizer.model and the *.tiktoken files (sorted) in the directory `path`; None if there is none."""
    if os.path.isfile(path):
        return path
    found = [os.path.join(path, name) for name in ("tokenizer.json", "tokenizer.model")]
    found += sorted(glob.glob(os.path.join(glob.escape(path), "*.tiktoken")))
    return next((p for p in found if os.path.isfile(p)), None)


def tokenizer_files(directory: str) -> list[str]:
    """The files a `PretrainedTokenizer` of `directory` reads (none where it has no tokenizer file)."""
    found = find_tokenizer(directory)
    if found is None:
        return []
    return [found, *(p for name in SPECIAL_FILES if os.path.isfile(p := os.path.join(directory, name)))]


def tokenizer_kind(path: str) -> str:
    """The library that reads the tokenizer file `path`: 'tokenizers' (a .json file), 'tiktoken' (lines of
    '<base64 token> <rank>'), else 'sentencepiece' (a protobuf; whether it parses is for sentencepiece to say)."""
    if path.endswith(".json"):
        return "tokenizers"
    with open(path, "rb") as f:
        head = f.readline(1024)
    return "tiktoken" if re.fullmatch(rb"[A-Za-z0-9+/]+=* \d+\r?\n?", head) else "sentencepiece"


def read_json(path: str, error: type[Exception] = DataError) -> dict:
    """The JSON object in the file `path`; `error` naming the file where it is not one (damaged,
    cut short, another kind of JSON)."""
    try:
        with open(path) as f:
            content = json.load(f)
    except ValueError as e:
        raise error(f"{path} is not valid JSON ({e}); the file is damaged or cut short: restore it from the "
                    "checkpoint") from None
    if not isinstance(content, dict):
        raise error(f"{path} holds a JSON {type(content).__name__}, not an object; restore it from the checkpoint")
    return content


def _special_id(name: str, files: dict[str, dict], backend: Backend, path: str) -> int | None:
    """The id of special token `name` ('bos', 'eos' or 'pad'): from the first of `files` (SPECIAL_FILES
    found beside the tokenizer file `path`, {name: content}) that names it, else the tokenizer's own."""
    for file, fields in files.items():
        where = os.path.join(os.path.dirname(path), file)
        if file in SPECIAL_FILES[:2]:
            token = fields.get(f"{name}_token")
            token = token.get("content") if isinstance(token, dict) else token
            if token is None:
                continue
            found = backend.token_id(token) if isinstance(token, str) else None
            if found is None:
                raise DataError(f"{where}: {name}_token {token!r} is not a token of {path}; correct it or remove it")
            return found
        found = fields.get(f"{name}_token_id")
        found = (found or [None])[0] if isinstance(found, list) else found
        if found is None:
            continue
        if type(found) is not int or not 0 <= found < backend.vocab_size:
            raise DataError(f"{where}: {name}_token_id={found!r} is not a token id of {path} (0 to "
                            f"{backend.vocab_size - 1}); correct it or remove it")
        return found
    return backend.own.get(name)


class PretrainedTokenizer:
    """A pretrained model's own tokenizer: a checkpoint directory's tokenizer.json (the tokenizers
    library), tokenizer.model (sentencepiece, or a tiktoken BPE-ranks file as Llama 3's original
    checkpoints ship it) or *.tiktoken file (`find_tokenizer`), or one such file. A tiktoken file holds
    only ranks: it is split by Llama 3's pattern, and its special tokens are tokenizer_config.json's
    added_tokens_decoder where the directory has one, else Llama 3's 256 after the ranks.

    encode(text) gives the text's ids as the model's tokenizer does, without special tokens (a text
    that spells one, "<|endoftext|>", is text). encode(text, continuation=True) gives the ids of the
    text where it follows other text, as the model reads it in the middle of a document: a
    sentencepiece model's without its dummy prefix (add_dummy_prefix, Llama 2's: encode("a") is
    "▁a", a continuation "a"); a tokenizer.json's without the space its normalizer or pre-tokenizer
    puts first (`_without_prefix_space`: Llama 2's and Mistral's; the byte-level BPEs of Llama 3 and
    Qwen2 put none, and are read as by encode); tiktoken's as encode (it puts none).

    decode skips special tokens and ids outside the tokenizer's vocabulary (a model's embedding may
    have more rows). bos_id, eos_id and pad_id are the model's: from the first of SPECIAL_FILES
    beside the tokenizer file that names each, else the file's own (pad: EOS where the model has
    none; bos: None). add_bos: the model reads BOS before each document (tokenizer_config.json's
    add_bos_token, else what the tokenizer does: a tokenizer.json whose post-processor prepends a
    token, a sentencepiece or tiktoken model that has a BOS).
    """

    def __init__(self, path: str):
        self.path = find_tokenizer(path)
        if self.path is None:
            why = ("has no tokenizer.json, tokenizer.model or *.tiktoken file" if os.path.isdir(path)
                   else "does not exist")
            raise DataError(f"tokenizer path {path} {why}; give a checkpoint directory that has one, or the file")
        folder = os.path.dirname(self.path)
        files = {name: read_json(p) for name in SPECIAL_FILES if os.path.isfile(p := os.path.join(folder, name))}
        self.kind = tokenizer_kind(self.path)
        backend = {"tokenizers": _tokenizers_backend, "sentencepiece": _sentencepiece_backend,
                   "tiktoken": _tiktoken_backend}[self.kind](self.path, files)
        self._encode, self._decode, self.vocab_size = backend.encode, backend.decode, backend.vocab_size
        self._continuation = backend.continuation
        self.bos_id, self.eos_id, self.pad_id = (_special_id(name, files, backend, self.path)
                                                 for name in ("bos", "eos", "pad"))
        if self.eos_id is None:
            raise DataError(f"{self.path}: the model has no EOS token (no eos_token or eos_token_id in any of "
                            f"{', '.join(SPECIAL_FILES)} beside it, none in the tokenizer): add one to "
                            "tokenizer_config.json; documents end in it")
        self.pad_id = self.eos_id if self.pad_id is None else self.pad_id
        add_bos = files.get("tokenizer_config.json", {}).get("add_bos_token", backend.add_bos)
        self.add_bos = bool(add_bos) and self.bos_id is not None
        self._skip = {self.bos_id, self.eos_id, self.pad_id, *backend.skip}

    def encode(self, text: str | bytes, continuation: bool = False) -> np.ndarray:
        """Returns int32[n]."""
        encode = self._continuation if continuation else self._encode
        return np.asarray(encode(_as_str(text)), dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        return self._decode([i for i in ids if 0 <= i < self.vocab_size and i not in self._skip])


def encode_document(tokenizer, text: str | bytes) -> np.ndarray:
    """A document as a model reads it: BOS where it expects one (`add_bos`), the text's ids, EOS: int32[n]."""
    bos = [tokenizer.bos_id] if tokenizer.add_bos else []
    return np.concatenate([bos, tokenizer.encode(text), [tokenizer.eos_id]]).astype(np.int32)


Tokenizer = ByteTokenizer | SentencePieceTokenizer | PretrainedTokenizer
TOKENIZERS = ("byte", "sentencepiece", "hf")


def _write_atomically(path: str, content: bytes) -> None:
    """Writes via a temporary file and a rename, so readers never see a half-written file; on
    failure, the temporary file and the folders this call created are removed."""
    folder = os.path.dirname(path) or "."
    new_dirs = absent_dirs(folder)
    os.makedirs(folder, exist_ok=True)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            os.unlink(tmp)
        remove_empty_dirs(new_dirs)
        raise


def get_tokenizer(
    name: str,
    data_dir: str,
    *,
    corpus_id: str = "",
    train_texts: Callable[[], Iterable[str]] | None = None,
    vocab_size: int = 8192,
    path: str = "",
) -> Tokenizer:
    """Returns the tokenizer `name` ('byte', 'sentencepiece' or 'hf').

    A sentencepiece model is cached as `<data_dir>/tokenizers/spm-<corpus_id>-<vocab_size>.model`
    and trained on `train_texts()` (the corpus' train split) the first time it is asked for. 'hf' is
    the `PretrainedTokenizer` of `path` (a checkpoint directory or its tokenizer file).
    """
    if name == "byte":
        return ByteTokenizer()
    if name == "hf":
        if not path:
            raise DataError("data.tokenizer='hf' reads a pretrained model's tokenizer: set data.tokenizer_path to its "
                            "checkpoint directory or tokenizer file")
        return PretrainedTokenizer(path)
    if name == "sentencepiece":
        safe_id = re.sub(r"[^A-Za-z0-9_.-]+", "_", corpus_id) or "corpus"
        model_path = os.path.join(data_dir, "tokenizers", f"spm-{safe_id}-{vocab_size}.model")
        if os.path.exists(model_path):
            return SentencePieceTokenizer(model_path)
        if train_texts is None:
            raise DataError(f"No sentencepiece model at {model_path} and no train texts to train one on.")
        return SentencePieceTokenizer.train(train_texts(), vocab_size, model_path)
    raise ValueError(f"Unknown tokenizer {name!r}; valid names: {', '.join(TOKENIZERS)}.")
