"""Write the Hugging Face parity fixtures of tests/lab/test_hf_import.py (needs torch and transformers,
which the project does not: `pip install .[fixtures]` in a separate environment).

    python tests/data/hf/make_fixtures.py                   # rewrites tests/data/hf/<name>/, every one
    python tests/data/hf/make_fixtures.py mistral_window    # only those named

Each fixture is a tiny randomly initialised model saved with `save_pretrained` (safetensors)
and `expected.npz`, computed by the checkpoint as Hugging Face loads it back from that
directory (eager attention, a fresh model for every computation, since dynamic RoPE keeps
state between calls):

  tokens_a, logits_a   16 tokens and their logits [16, vocab]
  tokens_b, logits_b   40 tokens, past max_position_embeddings for dynamic scaling
  prompt, generated    28 tokens, and those followed by 8 greedy new tokens (KV-cache decode;
                       it crosses position 32, dynamic scaling's max_position_embeddings)

logits_* and generated are computed in float32 (for the bf16 checkpoint: on its weights
widened exactly to float32); the bf16 checkpoint also has logits_*_bf16, computed in bf16
as Hugging Face runs it by default.

Weights are drawn larger than Hugging Face's init (std 0.02), so that attention is far from
uniform and positions matter: linear maps 1.5 / sqrt(fan_in), norm weights 1 + 0.2 N(0, 1),
biases 0.3 N(0, 1). Some configs are rewritten in the older config.json layout (top-level
rope_theta, `rope_scaling` with "rope_type" or "type"), which most published checkpoints use.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import torch
from transformers import (AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GenerationConfig, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Olmo2Config, Olmo2ForCausalLM,
                          Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          SmolLM3Config, SmolLM3ForCausalLM)

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32)

# name -> (model class, config, torch dtype, save_pretrained options, config.json layout)
FIXTURES = {
    # rope_theta 100 with head_dim 8: the pairs' L / wavelength are 5.1, 1.6, 0.51, 0.16 at
    # L = 32, so llama3 keeps one pair, ramps one and divides two.
    "llama": (LlamaForCausalLM, LlamaConfig(**SMALL, vocab_size=64, max_position_embeddings=64, rms_norm_eps=1e-5,
                                            rope_parameters=dict(rope_theta=100.0, **LLAMA3)),
              torch.float32, {}, "rope_type"),
    "llama_linear": (LlamaForCausalLM, LlamaConfig(**SMALL, vocab_size=64, max_position_embeddings=32,
                                                   rope_parameters=dict(rope_theta=10000.0, rope_type="linear",
                                                                        factor=2.0)),
                     torch.float32, {"max_shard_size": "20KB"}, "type"),
    "llama_dynamic": (LlamaForCausalLM, LlamaConfig(**SMALL, vocab_size=64, max_position_embeddings=32,
                                                    rope_parameters=dict(rope_theta=100.0, rope_type="dynamic",
                                                                         factor=2.0)),
                      torch.float32, {}, "new"),
    "llama_yarn": (LlamaForCausalLM, LlamaConfig(**SMALL, vocab_size=64, max_position_embeddings=128,
                                                 rope_parameters=dict(rope_theta=100.0, rope_type="yarn", factor=4.0,
                                                                      original_max_position_embeddings=32)),
                   torch.float32, {}, "new"),
    # head_dim 16, not hidden_size / heads = 8.
    "mistral": (MistralForCausalLM, MistralConfig(**SMALL, vocab_size=64, head_dim=16, max_position_embeddings=64,
                                                  sliding_window=None, rope_parameters=dict(rope_theta=1e6)),
                torch.float32, {}, "rope_type"),
    # Vocabulary 260 covers the byte-level tokens (258) of the default corpus: the eval.py and
    # init_from tests use this one.
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SMALL, vocab_size=260, max_position_embeddings=64,
                                            tie_word_embeddings=True, rms_norm_eps=1e-6,
                                            rope_parameters=dict(rope_theta=1e6)),
              torch.float32, {}, "new"),
    # Like Llama 3.2 1B / 3B: bf16, tied embeddings, llama3 scaling.
    "llama_bf16": (LlamaForCausalLM, LlamaConfig(**SMALL, vocab_size=64, max_position_embeddings=64,
                                                 tie_word_embeddings=True,
                                                 rope_parameters=dict(rope_theta=100.0, **LLAMA3)),
                   torch.bfloat16, {}, "rope_type"),
    # Sliding windows of 6 tokens, which the 16- and 40-token inputs and the generation pass:
    # Mistral's in every layer; Qwen2's in the layers from max_window_layers (1) on.
    "mistral_window": (MistralForCausalLM, MistralConfig(**SMALL, vocab_size=64, head_dim=16, max_position_embeddings=64,
                                                         sliding_window=6, rope_parameters=dict(rope_theta=100.0)),
                       torch.float32, {}, "rope_type"),
    "qwen2_window": (Qwen2ForCausalLM, Qwen2Config(**SMALL, vocab_size=64, max_position_embeddings=64,
                                                   use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                                   rope_parameters=dict(rope_theta=100.0)),
                     torch.float32, {}, "new"),
    # QK-norm per head before RoPE, the second layer in a window of 6.
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SMALL, vocab_size=64, head_dim=16, max_position_embeddings=64,
                                            use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                            rope_parameters=dict(rope_theta=100.0)),
              torch.float32, {}, "new"),
    # No RoPE in the second layer (no_rope_layers 0), tied embeddings.
    "smollm3": (SmolLM3ForCausalLM, SmolLM3Config(**SMALL, vocab_size=64, max_position_embeddings=64,
                                                  no_rope_layers=[1, 0], pad_token_id=0,
                                                  rope_parameters=dict(rope_theta=100.0)),
                torch.float32, {}, "rope_type"),
    # QK-norm over the whole projection, norms after each sublayer.
    "olmo2": (Olmo2ForCausalLM, Olmo2Config(**SMALL, vocab_size=64, max_position_embeddings=64,
                                            rope_parameters=dict(rope_theta=100.0)),
              torch.float32, {}, "new"),
    # A local layer (window 6, base 10) then a global one (base 100, linear scaling 2), the
    # sandwich norms, GeGLU, scaled embeddings, queries scaled by 1/sqrt(24) (not head_dim 16).
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(**SMALL, vocab_size=64, head_dim=16, max_position_embeddings=64,
                                                   query_pre_attn_scalar=24, sliding_window=6,
                                                   layer_types=["sliding_attention", "full_attention"],
                                                   rope_parameters={"sliding_attention": dict(rope_type="default",
                                                                                              rope_theta=10.0),
                                                                    "full_attention": dict(rope_type="linear",
                                                                                           rope_theta=100.0,
                                                                                           factor=2.0)}),
               torch.float32, {}, "new"),
    # Fused q/k/v and gate/up tensors; LongRoPE past 32 tokens (the 40-token input and the
    # generation cross it); three quarters of each head rotated.
    "phi3": (Phi3ForCausalLM, Phi3Config(**SMALL, vocab_size=64, max_position_embeddings=128,
                                         original_max_position_embeddings=32, sliding_window=None, pad_token_id=0,
                                         rope_parameters=dict(rope_type="longrope", rope_theta=100.0,
                                                              partial_rotary_factor=0.75,
                                                              short_factor=[1.0, 1.3, 2.0],
                                                              long_factor=[1.5, 3.0, 7.0])),
             torch.float32, {}, "new"),
}


def randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(1.5 * noise / p.shape[1] ** 0.5)


def old_layout(path: str, key: str) -> None:
    """Rewrite config.json in the layout of transformers 4.x: rope_theta at the top level and
    the scaling in `rope_scaling`, its type under `key` ("rope_type", or the older "type")."""
    with open(path) as f:
        cfg = json.load(f)
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type")
    cfg["rope_scaling"] = None if kind == "default" else {key: kind, **params}
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def load(directory: str, dtype) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager")
    model.generation_config = GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=None,
                                               pad_token_id=0, bos_token_id=None)
    return model.eval()


@torch.no_grad()
def expected(directory: str, dtype, tokens: dict) -> dict:
    """Logits of the two sequences and the greedy continuation of the prompt, each from a
    freshly loaded model (dynamic RoPE keeps its frequencies between calls)."""
    out = {}
    for name in ("a", "b"):
        ids = torch.as_tensor(tokens[f"tokens_{name}"])[None]
        out[f"logits_{name}"] = load(directory, dtype)(ids).logits[0].float().numpy()
    prompt = torch.as_tensor(tokens["prompt"])[None]
    # An explicit mask: generate would otherwise mask the prompt's tokens equal to pad_token_id.
    generated = load(directory, dtype).generate(prompt, attention_mask=torch.ones_like(prompt))[0].numpy()
    assert generated.shape == (len(tokens["prompt"]) + 8,), generated.shape
    out["generated"] = generated
    return out


def main(names) -> None:
    for seed, (name, (cls, config, dtype, save_options, layout)) in enumerate(FIXTURES.items()):
        if names and name not in names:
            continue
        directory = os.path.join(HERE, name)
        shutil.rmtree(directory, ignore_errors=True)
        torch.manual_seed(seed)
        model = cls(config)
        randomise(model, seed)
        model.to(dtype).save_pretrained(directory, safe_serialization=True, **save_options)
        os.remove(os.path.join(directory, "generation_config.json"))  # not read by the import
        if layout != "new":
            old_layout(os.path.join(directory, "config.json"), layout)
        rng = np.random.default_rng(seed)
        vocab = config.vocab_size
        tokens = {"tokens_a": rng.integers(0, vocab, 16), "tokens_b": rng.integers(0, vocab, 40),
                  "prompt": rng.integers(0, vocab, 28)}
        arrays = {**tokens, **expected(directory, torch.float32, tokens)}
        if dtype != torch.float32:
            computed = expected(directory, dtype, tokens)
            arrays |= {f"{k}_bf16": v for k, v in computed.items() if k.startswith("logits")}
        np.savez(os.path.join(directory, "expected.npz"),
                 **{k: v.astype(np.int32) if v.dtype.kind == "i" else v for k, v in arrays.items()})
        print(name, sorted(os.listdir(directory)))


if __name__ == "__main__":
    main(sys.argv[1:])
