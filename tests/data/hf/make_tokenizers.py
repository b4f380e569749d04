"""Write the tokenizer fixtures of tests/data/test_data_tokenizers.py and tests/lab/test_hf_import.py (needs the
tokenizers and sentencepiece packages: `pip install -e .[tokenizers]`):

    python tests/data/hf/make_tokenizers.py    # rewrites tests/data/hf/tokenizers/<name>/

Each is a tiny tokenizer trained on TEXTS below, laid out as a published family's:

  json/      tokenizer.json (the tokenizers library) as Llama 3's: a byte-level BPE of 300 tokens whose
             pre-tokenizer splits by Llama 3's pattern, then <|begin_of_text|> (300) and <|end_of_text|> (301),
             a post-processor that prepends <|begin_of_text|>; tokenizer_config.json names both.
  json_llama2/
             tokenizer.json as Llama 2's (and Mistral 7B v0.1's): a BPE of 400 tokens with byte fallback (<unk>
             0, <s> 1, </s> 2, <0x00> ... <0xFF> 3 to 258), a normalizer that prepends "▁" (the dummy prefix) and
             writes spaces as "▁", no pre-tokenizer (trained split at "▁", so no token spans two words), a decoder
             that strips the one leading space, a post-processor that prepends <s>; tokenizer_config.json names
             <s> and </s>.
  spm/       tokenizer.model (sentencepiece) as Llama 2's: BPE with byte fallback, <unk> 0, <s> 1, </s> 2, no
             pad piece, a dummy prefix; special_tokens_map.json names <s> and </s>, generation_config.json
             gives pad_token_id 0 (Llama 2's).
  tiktoken/  tokenizer.model in tiktoken's BPE-ranks format, as Llama 3's original checkpoints ship it: json/'s
             BPE, each token's bytes and id ("<base64> <rank>" per line), and no other file (the special tokens
             are then Llama 3's 256 after the ranks).
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil

import sentencepiece as spm
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizers")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A tokenizer turns text into tokens, and tokens back into text.",
    "def forward(self, tokens):\n    return self.head(self.blocks(tokens))\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "The pass key is 71432. Remember it. What is the pass key?",
    "Position schemes rotate queries and keys; the rotation depends on the distance.",
]


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet (GPT-2's): printable bytes stand for themselves, the others for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def write_json(folder: str, name: str, content: dict) -> None:
    with open(os.path.join(folder, name), "w") as f:
        json.dump(content, f, indent=2)


def make_json(folder: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TEXTS, trainer)
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 300)])])
    tok.save(os.path.join(folder, "tokenizer.json"), pretty=False)
    write_json(folder, "tokenizer_config.json", {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                                                 "tokenizer_class": "PreTrainedTokenizerFast"})
    return tok


def make_json_llama2(folder: str) -> None:
    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")  # training only
    # Trained on lines, as make_spm: a newline is then byte fallback (<0x0A>), as in Llama 2.
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[*specials, *(f"<0x{b:02X}>" for b in range(256))],
                                  show_progress=False)
    tok.train_from_iterator((line for text in TEXTS for line in text.splitlines()), trainer)
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    content = json.loads(tok.to_str())
    # The byte pieces are model tokens (decoded by ByteFallback), not special added tokens that decode would skip.
    content["added_tokens"] = [t for t in content["added_tokens"] if t["content"] in specials]
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write(Tokenizer.from_str(json.dumps(content)).to_str())
    write_json(folder, "tokenizer_config.json", {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>",
                                                 "eos_token": "</s>", "unk_token": "<unk>",
                                                 "tokenizer_class": "LlamaTokenizerFast"})


def make_spm(folder: str) -> None:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(line for text in TEXTS for line in text.splitlines()), model_writer=model,
        vocab_size=320, model_type="bpe", byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        allow_whitespace_only_pieces=True, split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        hard_vocab_limit=False, num_threads=1, minloglevel=2)
    with open(os.path.join(folder, "tokenizer.model"), "wb") as f:
        f.write(model.getvalue())
    write_json(folder, "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    write_json(folder, "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})


def make_tiktoken(folder: str, tok: Tokenizer) -> None:
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    ranks = sorted((i, bytes(byte_of[c] for c in token)) for token, i in tok.get_vocab(with_added_tokens=False).items())
    assert [i for i, _ in ranks] == list(range(300))
    with open(os.path.join(folder, "tokenizer.model"), "wb") as f:
        f.writelines(base64.b64encode(token) + b" %d\n" % i for i, token in ranks)


def main() -> None:
    folders = {name: os.path.join(HERE, name) for name in ("json", "json_llama2", "spm", "tiktoken")}
    for folder in folders.values():
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
    tok = make_json(folders["json"])
    make_json_llama2(folders["json_llama2"])
    make_spm(folders["spm"])
    make_tiktoken(folders["tiktoken"], tok)
    for name, folder in folders.items():
        print(name, {f: os.path.getsize(os.path.join(folder, f)) for f in sorted(os.listdir(folder))})


if __name__ == "__main__":
    main()
