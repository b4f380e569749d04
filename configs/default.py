"""Base config every experiment starts from: a small byte-level LM on the embedded corpus.

Use: `train.py --config configs/default.py[:SCHEME] --config.train.steps=500 ...`
The optional SCHEME picks `model.scheme` (any registered name; the grammar is configs/__init__.py's).
"""

import ml_collections

from configs import SCHEME, parse_arg
from data import default_data_config
from models.registry import config_defaults


FIELDS = (("scheme", "rope", SCHEME),)
# The evaluators' names (lab/evaluators.py's EVALUATORS, which configs cannot import; a test holds
# the two equal): each has a group of options in `eval_options`.
EVALUATORS = ("lengths", "transport", "near_far", "decompositions", "perturbations", "feature_shift", "analysis",
              "retrieval")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    scheme = parse_arg(__file__, arg, FIELDS)["scheme"]
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.arm = ""  # the experiment arm this run is (lab/sweep.py sets it; reports group seeds by it)
    c.dry_run = False  # compile the sharded train step and print per-device memory; train nothing
    c.workdir = ""  # '' means runs/<config name>-<scheme>

    c.model = ml_collections.ConfigDict(dict(
        vocab_size=0,  # 0: taken from the tokenizer
        d_model=256, num_layers=4, num_heads=4, num_kv_heads=0, head_dim=0, mlp_dim=0,
        scheme=scheme,
        scheme_options=ml_collections.ConfigDict({}),  # e.g. {'base': 5e5, 'scaling': 'yarn'}
        window=0,  # every layer's sliding window (0: none)
        chunk=0,  # every layer's attention chunk (0: none): Llama 4's chunked local attention
        # Per-layer attention (models/layers.py): kinds {name: {scheme, scheme_options, window}}, a
        # pattern of them repeated over the layers ("local*5,global"), single layers ("0=global").
        layer_kinds=ml_collections.ConfigDict({}), layer_pattern="", layer_overrides="",
        tie_embeddings=True,
        scale_tied_logits=True,  # tied head: logits x E^T / sqrt(d_model); False: x E^T (HF checkpoints)
        qkv_bias=False,  # biases on the q, k, v projections (Qwen2)
        qk_norm="none",  # "head" (Qwen3, Gemma 3) or "projection" (OLMo 2): RMS norm of q and k
        sinks=False,  # a learned sink logit per head in each row's softmax (gpt-oss)
        init="normal",  # linear layers: "normal" N(0, 1/fan_in) weights, zero biases; "torch" (models/layers.py)
        norm_eps=1e-6,  # RMSNorm epsilon
        norms="pre",  # "pre" | "post" (OLMo 2) | "sandwich" (Gemma 2/3): where each block's norms sit
        norm_offset=0.0,  # norms scale by offset + their learned scale (Gemma: 1.0)
        mlp_act="silu",  # the gated MLP's activation: "silu" (SwiGLU) | "gelu_tanh" (Gemma's GeGLU)
        embed_scale=False,  # embeddings times sqrt(d_model) (Gemma)
        scale_dim=0,  # attention logits q.k / sqrt(scale_dim); 0: head_dim (Gemma's query_pre_attn_scalar)
        attention_impl="auto",  # the fastest valid per platform (positional/attention.py), or by name:
        # 'reference' | 'blockwise' | 'ring' | 'pallas' | 'cudnn' | 'splash
        block_size=512,
        dtype="float32",  # compute dtype ("bfloat16": bf16 matmuls, fp32 parameters and optimizer)
        remat="none",  # "none" | "block" | "dots": what each block keeps for the backward pass
        mixer="attention",  # or a Sessa macro-block mixer (configs/sessa.py, models/sessa.py)
        mixer_options=ml_collections.ConfigDict({}),  # e.g. {'solve': 'blocked'} for Sessa
    ))

    c.model.update(config_defaults(c.model.scheme))  # what the scheme's classes declare (PaTH's block_size)

    c.data = default_data_config()
    c.seq_len = 256  # training length: tokens the model attends over per row
    c.batch_size = 16  # global batch, rows

    c.train = ml_collections.ConfigDict(dict(
        steps=2000, lr=3e-3, min_lr_ratio=0.1, warmup_steps=100,
        weight_decay=0.1, b1=0.9, b2=0.95, grad_clip=1.0,
        log_every=20, checkpoint_every=500, keep_checkpoints=2,
        eval_every=0, eval_tokens=65536,  # validation loss at the training length; 0 = off
        # The NaN guard also stops a loss above this many times the median of the last 50
        # logged, so no checkpoint of a blown-up state is kept; 0 turns that part off.
        explode_factor=10.0,
        param_dtype="float32",  # parameters' storage: "bfloat16" halves them (optimizer state stays fp32)
        async_checkpoints=True,  # a save is written while training goes on
        # Weight decay on the position schemes' learned matrices too (lab.state.decayed); every
        # result in docs/results/ so far trained with it. False exempts them like norms' scales.
        decay_position_params=True,
    ))
    # Continue from another run's parameters (fresh optimizer and step counter): the
    # pretrain-then-extend workflow. A directory of checkpoints; its latest complete one is used.
    c.init_from = ""

    # Mesh axis sizes; -1 takes the remaining devices. models/sharding.py maps the model onto
    # them: batch over data x fsdp, parameters and optimizer state over fsdp (embed) and tensor
    # (heads, mlp, vocab), activations' sequence dimension over sequence.
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, sequence=1))
    # Several processes (TPU pod slices, multi-node GPU; lab/distributed.py): a cluster launcher JAX
    # detects, or coordinator (host:port of process 0) with num_processes and process_id given here.
    c.distributed = ml_collections.ConfigDict(dict(
        coordinator="", num_processes=0, process_id=-1,  # '', 0, -1: detected (one process if no cluster)
        timeout_s=300,  # how long start-up waits for every process to connect
        heartbeat_s=30))  # a process silent this long (killed, hung, host lost) ends the job

    c.eval = ml_collections.ConfigDict(dict(
        multipliers=(0.5, 1, 2, 4, 8, 16),  # evaluation lengths as multiples of seq_len
        tokens=32768,  # tokens scored at every length (the same tokens for every length)
        stride=0,  # 0: non-overlapping windows; else sliding windows advancing by `stride`
        # True: only documents longer than the longest length, no window crossing a document's end;
        # False: the documents laid end to end (the protocol of the tables committed before 2026-11-24)
        within_documents=True,
        # Within documents: 0 takes whole documents until `tokens` targets (few: two at 8,192 tokens
        # in the default corpus); N > 0 takes the first N documents (of at least the longest length + 1
        # tokens) with the targets spread evenly over them, each document's NLL kept for a bootstrap
        # over documents (lab.stats.bootstrap): max(tokens, N x the longest length) targets.
        documents=0,
        batch_size=4,
        blockwise_from=2048,  # lengths from here on use blockwise attention
        split="validation",
        task_examples=0,  # synthetic tasks: examples scored (0: all of the task's eval_examples)
    ))
    c.evals = ""  # evaluators (lab/evaluators.py) run in training every train.eval_every steps: "lengths,transport"
    # Their options, one group per evaluator: --config.eval_options.transport.length=512 (the
    # evaluator's keyword arguments, lab/evaluators.py; eval.py spells them the same).
    c.eval_options = ml_collections.ConfigDict({name: {} for name in EVALUATORS})
    return c
