"""Import a Hugging Face checkpoint of the Llama family (Llama 2 / 3.x, Mistral, Qwen2 / 2.5, Qwen3,
SmolLM3, OLMo 2, Gemma 3's text model, Phi-3) as a run directory of this project: config.json and an orbax checkpoint at step 0 with its
identity, so `eval.py --workdirs=<dir>`, `lab.runs.load_run` and `train.py
--config.init_from=<dir>` take it as they take a trained run.

The checkpoint is a local directory: config.json and model.safetensors, or shards named by
model.safetensors.index.json. The safetensors format is read here, with no dependency of its
own: an 8-byte little-endian header length, a JSON header of dtype, shape and byte offsets,
then the raw little-endian tensors (BF16 read as jax.numpy.bfloat16, ml_dtypes' type). Tensors
are memory maps, and each device reads only its slice (`jax.make_array_from_callback` into the
shardings of the abstract train state), so a model larger than one device's memory loads
sharded (`fsdp`, `tensor`).

The mapping: DecoderLM is the same network. RMSNorm blocks with the checkpoint's epsilon
(`model.norm_eps`), a gated MLP (gate, up, down), grouped-query attention whose query head h
reads key/value head h // (H / K) as in HF's repeat_kv, what each family adds
(`FAMILY_FIELDS`: Qwen2's q/k/v biases, QK-norm, OLMo 2's and Gemma's norms, Gemma's GeGLU and
scales), each layer's attention (`layer_attention`: windows, RoPE per layer type, SmolLM3's NoPE
layers), Phi-3's fused tensors read in parts (`FUSED`), an explicit head_dim, the embedding
unscaled (but Gemma's) and a tied head unscaled (`model.scale_tied_logits=False`). RoPE pairs
(x[i], x[i + D/2]) like HF's rotate_half: the "half" layout, with no permutation of the q/k
weights. HF Linear weights [out, in] become kernels [in, out] (transposed). rope_scaling types:
linear -> "pi", dynamic -> "dynamic", yarn -> "yarn" with HF's index ramp and attention factor,
llama3 -> "llama3", longrope / su -> "longrope" (positional/rope.py); partial_rotary_factor ->
rotary_dim. bf16 checkpoints stay bf16 (`train.param_dtype`), others load as fp32; compute is fp32 (`model.dtype`, not part of a run's identity, so config.json may change it).

The checkpoint's tokenizer (tokenizer.json, else tokenizer.model, else *.tiktoken, with the files
that name its special tokens: `data.tokenizers.tokenizer_files`) is copied into <workdir>/tokenizer
and the run's data config reads text with it (`data.tokenizer="hf"`), so evaluation sees text as
the model was trained on it; a checkpoint without one keeps the default byte-level tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import default
from data.tokenizers import PretrainedTokenizer, read_json, tokenizer_files
from lab.checkpoints import checkpoint_manager, identity, save
from lab.state import check_config, init_state, make_mesh
from models.registry import get_entry

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2", "gemma3_text", "phi3")
# What each family's block adds to Llama's (models/layers.py's ModelConfig fields); Gemma 3's
# scale_dim is its query_pre_attn_scalar.
FAMILY_FIELDS = {
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": "head"},
    "olmo2": {"qk_norm": "projection", "norms": "post"},
    "gemma3_text": {"qk_norm": "head", "norms": "sandwich", "norm_offset": 1.0, "mlp_act": "gelu_tanh",
                    "embed_scale": True},
}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF's hidden_act -> model.mlp_act
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope", "su")  # su: LongRoPE's older name
DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(jnp.bfloat16),
          "F64": np.dtype("<f8")}
# Tensors a checkpoint may hold that the model does not need: rotary frequencies older
# checkpoints saved as buffers (the model computes them).
IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")


@dataclasses.dataclass(frozen=True)
class Tensor:
    """Where a tensor's bytes are: file, absolute byte offset, dtype, shape."""
    file: str
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    def array(self) -> np.ndarray:
        """The tensor as a read-only memory map: slicing it reads only the bytes of the slice."""
        count = math.prod(self.shape)
        if count == 0:
            return np.zeros(self.shape, self.dtype)
        return np.memmap(self.file, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape)


def read_safetensors_header(path: str) -> dict[str, Tensor]:
    """{name: Tensor} of one .safetensors file, from its header alone."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
        length = int.from_bytes(raw, "little")
        size = os.fstat(f.fileno()).st_size
        if length > size - 8:
            raise ValueError(f"{path} is not a safetensors file (header length {length} > file size {size})")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise ValueError(f"{path} is not a safetensors file (its header is not JSON: {e})") from None
    start, out = 8 + length, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"tensor {name} in {path} has dtype {entry['dtype']}; readable: {', '.join(DTYPES)}")
        dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize or start + end > size:
            raise ValueError(f"tensor {name} in {path}: offsets {begin}..{end} do not hold {entry['dtype']} "
                             f"{list(shape)} inside the file ({size} bytes); the file is damaged")
        out[name] = Tensor(path, start + begin, dtype, shape)
    return out


def tensor_index(directory: str) -> dict[str, Tensor]:
    """{name: Tensor} of a checkpoint directory: model.safetensors, or the shards that
    model.safetensors.index.json names."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index, ValueError).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map (tensor name -> shard file); the file is damaged")
        out = {}
        for file in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(directory, file)):
                raise FileNotFoundError(f"{index} names the shard {file}, which is not in {directory} (a download "
                                        "cut short? fetch every shard the index names)")
            shard = read_safetensors_header(os.path.join(directory, file))
            out.update({name: t for name, t in shard.items() if weight_map.get(name) == file})
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise ValueError(f"{index} puts {missing[0]} in {weight_map[missing[0]]}, which does not hold it")
        return out
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(single):
        return read_safetensors_header(single)
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory} (only "
                            "safetensors checkpoints are read: save_pretrained(..., safe_serialization=True))")


def read_hf_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    if os.path.isfile(directory):
        raise NotADirectoryError(f"checkpoint directory {directory} is a file; pass the directory that holds "
                                 "config.json and the .safetensors files")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory} has no config.json: pass a Hugging Face checkpoint directory")
    return read_json(path, ValueError)


def rope_options(hf: dict, where: str, params: dict | None = None) -> dict:
    """Options of this project's "rope" scheme for the RoPE of an HF config: rope_theta and
    rope_scaling (transformers 4.x) or rope_parameters (5.x); `params` those of one layer type."""
    if params is None:
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"{where}: unsupported rope_scaling type {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    max_len = hf["max_position_embeddings"]
    # HF gives a top-level original_max_position_embeddings (Phi-3's layout) priority.
    original = int(hf.get("original_max_position_embeddings")
                   or params.get("original_max_position_embeddings", max_len))
    options = {"base": float(params.get("rope_theta", hf.get("rope_theta", 10000.0))), "layout": "half"}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
    if partial != 1:  # the first int(D x partial) dims rotate, with their own frequencies (HF's)
        options["rotary_dim"] = int((hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]) * partial)
    if kind == "linear":
        options |= {"scaling": "pi", "factor": float(params["factor"])}
    elif kind == "dynamic":
        options |= {"scaling": "dynamic", "factor": float(params["factor"]), "original_max_len": max_len}
    elif kind == "llama3":
        options |= {"scaling": "llama3", "factor": float(params["factor"]),
                    "low_freq_factor": float(params["low_freq_factor"]),
                    "high_freq_factor": float(params["high_freq_factor"]), "original_max_len": original}
    elif kind in ("longrope", "su"):
        factor = float(params.get("factor") or max_len / original)
        options |= {"scaling": "longrope", "factor": factor, "original_max_len": original,
                    "short_factor": tuple(map(float, params["short_factor"])),
                    "long_factor": tuple(map(float, params["long_factor"]))}
        if params.get("attention_factor") is not None:
            options["attention_factor"] = float(params["attention_factor"])
    elif kind == "yarn":
        factor = float(params.get("factor") or max_len / original)
        options |= {"scaling": "yarn", "factor": factor, "original_max_len": original,
                    "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
                    "ramp": "index" if params.get("truncate", True) else "index_exact",
                    "attention_factor": yarn_attention_factor(params, factor)}
    return options


def yarn_attention_factor(params: dict, factor: float) -> float:
    """YaRN's sqrt(1/t) as HF derives it: given, or from mscale / mscale_all_dim, or 0.1 ln s + 1."""
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
    return mscale(factor)


def model_fields(hf: dict, where: str) -> dict:
    """The model config fields of this project for an HF config (`where` names it in errors)."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        hint = (" (the multimodal Gemma 3: import a text-only gemma3_text checkpoint)" if kind == "gemma3" else "")
        raise ValueError(f"{where}: unsupported model_type {kind!r}{hint}; supported: {', '.join(SUPPORTED)}")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(f"{where}: hidden activation {act!r}; the gated MLP takes {', '.join(ACTIVATIONS)}")
    for flag, what in (("attention_bias", "q, k, v and o"), ("mlp_bias", "the MLP's")):
        if kind != "qwen2" and hf.get(flag):
            raise ValueError(f"{where}: {flag}=true (biases on {what} projections) is not supported")
    for flag in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(flag):
            raise ValueError(f"{where}: {flag}={hf[flag]} (a tanh cap on the logits, Gemma 2's) is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{where}: use_bidirectional_attention=true (an encoder) is not supported: the model is "
                         "causal")
    heads = hf["num_attention_heads"]
    extra = {"qkv_bias": False, "qk_norm": "none", "norms": "pre", **FAMILY_FIELDS.get(kind, {})}
    if kind == "gemma3_text":
        extra["scale_dim"] = int(hf.get("query_pre_attn_scalar") or 0)
    return {"vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"], "num_layers": hf["num_hidden_layers"],
            "num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads, "mlp_dim": hf["intermediate_size"],
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "scale_tied_logits": False,
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "mlp_act": ACTIVATIONS[act], **extra,
            **layer_fields(layer_attention(hf, where))}


LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_types(hf: dict, where: str) -> list[str]:
    """Each layer's type, full or sliding attention, as transformers builds the model: Mistral's
    and Phi-3's `sliding_window` in every layer; Qwen2's, Qwen3's and SmolLM3's, where
    use_sliding_window, in the layers `layer_types` says (else those from max_window_layers on);
    Gemma 3's as `layer_types` says (else every sliding_window_pattern-th layer full); none in
    Llama's and OLMo 2's."""
    n, kind = hf["num_hidden_layers"], hf.get("model_type")
    if not hf.get("sliding_window"):
        return ["full_attention"] * n
    if kind in ("mistral", "phi3"):
        return ["sliding_attention"] * n
    if kind == "gemma3_text":
        every = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
        types = hf.get("layer_types") or [LAYER_TYPES[(i + 1) % every != 0] for i in range(n)]
    elif kind in ("qwen2", "qwen3", "smollm3") and hf.get("use_sliding_window"):
        first = hf.get("max_window_layers", n)
        types = hf.get("layer_types") or [LAYER_TYPES[i >= first] for i in range(n)]
    else:
        return ["full_attention"] * n
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != n:
        raise ValueError(f"{where}: layer_types {unknown or types} cannot be imported: the importer takes one of "
                         f"{', '.join(LAYER_TYPES)} per layer ({n} layers)")
    return list(types)


def layer_attention(hf: dict, where: str) -> list[dict]:
    """Each layer's attention as {scheme, scheme_options, window}: RoPE with the options of its
    layer type (Gemma 3's local and global bases), its window, and no RoPE in SmolLM3's layers
    whose `no_rope_layers` entry is 0."""
    n, types = hf["num_hidden_layers"], layer_types(hf, where)
    params = dict(hf.get("rope_parameters") or {})
    per_type = bool(params) and all(isinstance(v, dict) for v in params.values())
    unknown = sorted(set(params) - set(LAYER_TYPES)) if per_type else []
    if unknown:
        raise ValueError(f"{where}: RoPE parameters for the layer type(s) {unknown}; the importer knows "
                         f"{', '.join(LAYER_TYPES)}")
    full = rope_options(hf, where, params.get("full_attention") if per_type else None)
    if per_type and "sliding_attention" in params:
        local = rope_options(hf, where, params["sliding_attention"])
    elif hf.get("rope_local_base_freq"):  # Gemma 3 in the transformers 4.x layout: plain RoPE
        local = {"base": float(hf["rope_local_base_freq"]), "layout": "half"}
    else:
        local = full
    rope = hf.get("no_rope_layers") or [1] * n
    if len(rope) != n:
        raise ValueError(f"{where}: no_rope_layers has {len(rope)} entries for {n} layers")
    window = hf.get("sliding_window") or 0
    return [{"scheme": "rope" if rope[i] else "nope",
             "scheme_options": (local if sliding else full) if rope[i] else {},
             "window": window if sliding else 0}
            for i, sliding in enumerate(t == "sliding_attention" for t in types)]


def layer_fields(layers: list[dict]) -> dict:
    """The model config fields of per-layer attention (models/layers.py): the model's scheme,
    options and window are the commonest full-attention layer's (the commonest layer's if every
    layer has a window); every other layer gets a kind, "sliding" (a window), "nope" (another
    scheme) or "layer" (other options), numbered where two differ, set by `layer_overrides`; a
    kind sets the fields where its layers differ from the model's (its scheme options whole, so
    none of the model's carries over)."""
    def key(layer):
        return json.dumps(layer, sort_keys=True)

    counts = {}
    for layer in layers:
        counts[key(layer)] = counts.get(key(layer), 0) + 1
    full = [k for k in counts if not json.loads(k)["window"]] or list(counts)
    base = json.loads(max(full, key=lambda k: counts[k]))
    fields = {"scheme": base["scheme"], "scheme_options": base["scheme_options"], "window": base["window"],
              "layer_kinds": {}, "layer_overrides": ""}
    names, overrides = {}, []
    for i, layer in enumerate(layers):
        if key(layer) == key(base):
            continue
        if key(layer) not in names:
            name = "sliding" if layer["window"] else layer["scheme"] if layer["scheme"] != base["scheme"] else "layer"
            name = name if name not in fields["layer_kinds"] else f"{name}{len(fields['layer_kinds'])}"
            names[key(layer)] = name
            kind = {"scheme": layer["scheme"]} if layer["scheme"] != base["scheme"] else {}
            if layer["window"] != base["window"]:
                kind["window"] = layer["window"]
            if not kind.get("scheme") and layer["scheme_options"] != base["scheme_options"]:
                kind["scheme_options"] = _all_options(layer, base)
            fields["layer_kinds"][name] = kind
        overrides.append(f"{i}={names[key(layer)]}")
    fields["layer_overrides"] = ",".join(overrides)
    return fields


def _all_options(layer: dict, base: dict) -> dict:
    """A layer's scheme options with every option the model's carries that it does not set given
    the scheme's default, so that the kind's options are the layer's own (models/layers.py: a
    kind of the model's scheme updates the model's options)."""
    defaults = {f.name: f.default for f in dataclasses.fields(get_entry(layer["scheme"]).scheme_cls)}
    return {**{k: defaults[k] for k in base["scheme_options"] if k not in layer["scheme_options"]},
            **layer["scheme_options"]}


def run_config(hf: dict, where: str, workdir: str, seq_len: int = 0,
               param_dtype: str = "float32") -> ml_collections.ConfigDict:
    """The run config of an imported checkpoint: configs/default.py with the checkpoint's model,
    training length `seq_len` (0: its max_position_embeddings) and parameter dtype. The data
    config is the default (the embedded corpus in byte-level tokens); `import_checkpoint` sets
    the checkpoint's own tokenizer where it has one."""
    config = default.get_config("rope")
    try:
        fields = model_fields(hf, where)
    except KeyError as e:
        raise ValueError(f"{where} has no {e.args[0]!r}, which a {hf.get('model_type')} config needs") from None
    config.model.update({k: v for k, v in fields.items() if k not in ("scheme_options", "layer_kinds")})
    config.model.scheme_options = ml_collections.ConfigDict(fields["scheme_options"])
    config.model.layer_kinds = ml_collections.ConfigDict(fields.get("layer_kinds", {}))
    config.workdir = workdir
    config.seq_len = seq_len or hf["max_position_embeddings"]
    config.train.param_dtype = param_dtype
    return config


# Each block's modules by the HF name of each family's (models/layers.py's Block and Attention);
# the norms by where `model.norms` puts them.
MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
NORM_MODULES = {"pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
                "post": {"attn_norm": "post_attention_layernorm", "mlp_norm": "post_feedforward_layernorm"},
                "sandwich": {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                             "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}}
# Phi-3 keeps q, k, v in one tensor and gate, up in another: (fused module, its part before this one).
FUSED = {"q": ("self_attn.qkv_proj", ()), "k": ("self_attn.qkv_proj", ("q",)), "v": ("self_attn.qkv_proj", ("q", "k")),
         "gate": ("mlp.gate_up_proj", ()), "up": ("mlp.gate_up_proj", ("gate",))}


def hf_name(path, cfg, fused: bool = False) -> tuple[str, bool, slice | None]:
    """(HF tensor name, whether it is transposed, the rows of it that are this parameter or None
    for all) of the parameter at `path` of DecoderLM whose model config (with every size given,
    as an import's) is `cfg`; `fused`: q, k, v and gate, up in Phi-3's fused tensors."""
    keys = tuple(str(getattr(k, "key", k)) for k in path)
    top = {("embed", "embedding"): "model.embed_tokens.weight", ("norm", "scale"): "model.norm.weight",
           ("head", "kernel"): "lm_head.weight"}
    if keys in top:
        return top[keys], keys[-1] == "kernel", None
    layer, *rest = keys[1:]
    part, leaf, rows = rest[-2], "bias" if rest[-1] == "bias" else "weight", None
    module = NORM_MODULES[cfg.norms].get(part) or MODULES[part]
    if fused and part in FUSED:
        module, before = FUSED[part]
        size = {"q": cfg.num_heads, "k": cfg.num_kv_heads, "v": cfg.num_kv_heads}
        size = {k: n * cfg.head_dim for k, n in size.items()} | {"gate": cfg.mlp_dim, "up": cfg.mlp_dim}
        start = sum(size[b] for b in before)
        rows = slice(start, start + size[part])
    return f"model.layers.{layer}.{module}.{leaf}", rest[-1] == "kernel", rows


def place_params(tensors: dict[str, Tensor], abstract, directory: str, cfg, fused: bool = False):
    """The parameters `abstract` describes (ShapeDtypeStructs with shardings), read from
    `tensors`: each device reads its own slice, converted to the parameter's dtype. `cfg` is
    the imported run's model config; `fused` as `hf_name`."""
    used = set()

    def place(path, target):
        name, transpose, rows = hf_name(path, cfg, fused)
        if name not in tensors:
            raise ValueError(f"missing tensor {name} in {directory}: its config.json describes a model that has it")
        t = tensors[name]
        expected = target.shape[::-1] if transpose else target.shape
        shape = t.shape if rows is None else (min(rows.stop, t.shape[0]) - rows.start, *t.shape[1:])
        if tuple(shape) != tuple(expected):
            raise ValueError(f"tensor {name} in {t.file} has shape {list(t.shape)}; config.json gives "
                             f"{list(expected)}" + ("" if rows is None else f" from its rows {rows.start}.."
                                                    f"{rows.stop - 1}"))
        used.add(name)
        source = t.array() if rows is None else t.array()[rows]

        def read(index):  # index: slices of the parameter, whose axes are the tensor's reversed if transposed
            part = source[index[::-1]].T if transpose else source[index]
            return np.asarray(part, target.dtype)

        return jax.make_array_from_callback(target.shape, target.sharding, read)

    params = jax.tree_util.tree_map_with_path(place, abstract)
    tied = cfg.tie_embeddings
    extra = sorted(n for n in set(tensors) - used if not IGNORED.search(n) and not (tied and n == "lm_head.weight"))
    if extra:
        raise ValueError(f"tensor {extra[0]} in {tensors[extra[0]].file} has no place in the model config.json "
                         f"describes{f' ({len(extra) - 1} more)' if len(extra) > 1 else ''}")
    return params


def checkpoint_dtype(tensors: dict[str, Tensor]) -> str:
    """bfloat16 when every tensor is bf16; float32 otherwise (fp16 and fp32 widen exactly)."""
    dtypes = {t.dtype for t in tensors.values()}
    return "bfloat16" if dtypes == {np.dtype(jnp.bfloat16)} else "float32"


# Published config.json values (Hugging Face hub, 2024-2025) of models people analyse, for dry runs
# of their shapes without their weights (benchmarks/eval_plans.py) and the config-reading tests.
_LLAMA3 = {"model_type": "llama", "vocab_size": 128256, "num_key_value_heads": 8, "max_position_embeddings": 131072,
           "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "hidden_act": "silu"}
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                "rope_type": "llama3"}
PUBLISHED = {
    "Llama-3.2-1B": {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "head_dim": 64, "tie_word_embeddings": True,
                     "rope_scaling": {"factor": 32.0, **_LLAMA3_ROPE}},
    "Llama-3.2-3B": {**_LLAMA3, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
                     "num_attention_heads": 24, "head_dim": 128, "tie_word_embeddings": True,
                     "rope_scaling": {"factor": 32.0, **_LLAMA3_ROPE}},
    "Llama-3.1-8B": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "tie_word_embeddings": False,
                     "rope_scaling": {"factor": 8.0, **_LLAMA3_ROPE}},
    "Qwen2.5-7B-YaRN": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                        "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
                        "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
                        "sliding_window": 131072, "use_sliding_window": False, "tie_word_embeddings": False},
    "Mistral-7B-v0.1": {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                        "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
                        "sliding_window": 4096, "tie_word_embeddings": False},
}

IMPORTING = ".{name}.importing-"  # + the importing process's id: the run being written, beside its workdir


def remove_stale_imports(workdir: str) -> None:
    """Remove the unfinished imports into `workdir` that a killed import left (SIGKILL, a lost
    machine), each with a note; FileExistsError if an import into it is running."""
    parent, prefix = os.path.dirname(workdir), IMPORTING.format(name=os.path.basename(workdir))
    for name in sorted(os.listdir(parent)):
        if not name.startswith(prefix) or not name[len(prefix):].isdigit():
            continue
        pid = int(name[len(prefix):])
        try:
            os.kill(pid, 0)
            alive = pid != os.getpid()
        except ProcessLookupError:
            alive = False
        except PermissionError:  # another user's live process
            alive = True
        if alive:
            raise FileExistsError(f"an import into {workdir} is running (process {pid}, writing "
                                  f"{os.path.join(parent, name)}); wait for it or stop it")
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        print(f"note: removed {os.path.join(parent, name)}, an import into {workdir} that process {pid} did not "
              "finish", file=sys.stderr)


def import_checkpoint(source: str, workdir: str, *, seq_len: int = 0, param_dtype: str = "",
                      fsdp: int = -1, tensor: int = 1) -> dict:
    """Convert the HF checkpoint directory `source` into the run directory `workdir`, which
    must not exist or be empty. The parameters are placed over a mesh of `fsdp` x `tensor`
    devices (-1: all devices) and saved from there. `param_dtype` "" keeps the checkpoint's
    (bf16, else fp32). Returns a summary: workdir, config, parameter count, caveats.

    The run is written into a temporary sibling directory, renamed into place once complete.
    """
    hf = read_hf_config(source)
    where = os.path.join(source, "config.json")
    workdir = os.path.abspath(workdir)
    if os.path.exists(workdir) and (not os.path.isdir(workdir) or os.listdir(workdir)):
        raise FileExistsError(f"{workdir} exists and is not empty; give the imported run a new directory")
    tensors = tensor_index(source)
    config = run_config(hf, where, workdir, seq_len, param_dtype or checkpoint_dtype(tensors))
    check_config(config)
    files = tokenizer_files(source)
    tokenizer = PretrainedTokenizer(files[0]) if files else None
    if tokenizer is not None:
        if tokenizer.vocab_size > config.model.vocab_size:
            raise ValueError(f"{tokenizer.path} has {tokenizer.vocab_size} tokens, more than the model's embedding "
                             f"rows ({where}: vocab_size {config.model.vocab_size}); these tokenizer files are not "
                             "this model's: replace them with the checkpoint's own")
        config.data.update(tokenizer="hf", tokenizer_path=os.path.join(workdir, "tokenizer"))
    placement = ml_collections.ConfigDict(dict(mesh=dict(data=1, fsdp=fsdp, tensor=tensor, sequence=1)))
    mesh = make_mesh(placement)
    _, _, _, _, abstract = init_state(config, config.model.vocab_size, mesh, abstract=True)
    params = place_params(tensors, abstract["params"], source, config.model, fused=hf["model_type"] == "phi3")
    step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))
    _write_run(workdir, config, {"params": params, "step": step}, source, files)
    notes = []
    if tokenizer is None:
        notes.append(f"{source} has no tokenizer (tokenizer.json, tokenizer.model or *.tiktoken): the run reads text "
                     "as byte-level tokens, which the model was not trained on")
        if config.model.vocab_size < 258:
            notes.append(f"its vocabulary ({config.model.vocab_size}) does not cover the byte-level tokens (258): "
                         "eval.py cannot score held-out text with it")
    return {"workdir": workdir, "config": config, "model_type": hf["model_type"], "tokenizer": tokenizer,
            "params": sum(math.prod(x.shape) for x in jax.tree.leaves(params)), "caveats": notes}


def _write_run(workdir: str, config, state: dict, source: str, files: list[str]) -> None:
    """Write the imported run (its checkpoint of `state`, the tokenizer `files`, config.json) into
    a temporary sibling of `workdir`, renamed into place once complete (removed on failure)."""
    os.makedirs(os.path.dirname(workdir), exist_ok=True)
    remove_stale_imports(workdir)
    partial = os.path.join(os.path.dirname(workdir), f"{IMPORTING.format(name=os.path.basename(workdir))}{os.getpid()}")
    try:
        os.makedirs(partial)
        manager = checkpoint_manager(os.path.join(partial, "checkpoints"))
        save(manager, state, {},
             {"step": 0, "loss": float("nan"), "identity": identity(config), "imported_from": os.path.abspath(source)})
        manager.wait_until_finished()
        manager.close()
        if files:
            os.makedirs(os.path.join(partial, "tokenizer"))
            for file in files:
                shutil.copy(file, os.path.join(partial, "tokenizer"))
        with open(os.path.join(partial, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))
        if os.path.isdir(workdir):
            os.rmdir(workdir)  # empty, checked above
        os.rename(partial, workdir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def train_flags(config) -> list[str]:
    """The train.py flags that rebuild the model of an imported run's `config` on
    configs/default.py (for `--config.init_from`) and read text with its tokenizer."""
    base = default.get_config(config.model.scheme).model
    flags = [f"--config.model.{k}={v}" for k, v in config.model.items()
             if k not in ("scheme_options", "layer_kinds") and base.get(k) != v]
    flags += [f"--config.model.scheme_options.{k}={v}" for k, v in config.model.scheme_options.items()]
    flags += [f"--config.model.layer_kinds.{k}={v.to_dict()!r}" for k, v in config.model.layer_kinds.items()]
    if config.train.param_dtype != "float32":
        flags.append(f"--config.train.param_dtype={config.train.param_dtype}")
    if config.data.tokenizer == "hf":
        flags += ["--config.data.tokenizer=hf", f"--config.data.tokenizer_path={config.data.tokenizer_path}"]
    return flags
