"""Offline lowering check: what impl="auto" picks for a config's training step on an
accelerator, checked on a CPU host without one.

    python benchmarks/lowering.py --platform tpu --config configs/default.py:alibi \
        --config.seq_len=8192 --config.model.dtype=bfloat16
    python benchmarks/lowering.py --platform cuda --config configs/default.py:rope --config.seq_len=8192

The config's model and optimizer state are built abstractly (jax.eval_shape: nothing is
allocated, whatever the model size or length), and its full training step (forward, backward
and the AdamW update: lab.state.make_train_step, as train.py and the dry run build it) is
exported with jax.export for that one platform. Nothing is compiled or run. Lowering on a CPU
host needs a stand-in per platform, set only while the step is lowered (`lab.lowering`).

It prints
  - each attention call site: the scheme's class, the impl "auto" chose for the platform and
    why (the DEBUG records of logger "positional.attention", identical lines counted once,
    with the layers they came from; a trace JAX reuses, as remat's for the blocks after the
    first, is one call site); schemes with their own attention resolve "auto" themselves and
    say so (path, path_fox: their ring on a sequence mesh, else the kernel; espr_rf by length);
  - the fused-kernel custom calls of one step: Triton (Pallas on GPU), Mosaic (tpu_custom_call:
    Pallas and splash on TPU) and cuDNN flash attention, counted apart, a call inside a
    function counted once per call of that function (and the count in the text, where other);
  - the largest tensor type in the StableHLO (shape, dtype, bytes), and whether any tensor has
    two axes of at least seq_len: a T x T buffer. The module is read after MLIR's canonicalize,
    symbol-dce and cse (`lab.lowering.simplified`): differentiating a platform_dependent leaves
    zeros for the other platforms' residuals (the CPU reference's [B, K, G, T, T] scores up to
    2,048 keys), dead code that XLA drops before allocating anything. Not counted as T x T:
    tensors shaped like a parameter (weights, their gradients and moments) and the vocabulary
    axis of a tensor of rank <= 3 (the logits [B, T, vocab] when vocab >= T), so a model wider
    than its sequence does not trip it (attention scores are rank 4 or 5).

Exit status 1, with one line on stderr ("error: ..."), when the scheme has a fused path (its
`impls` include "pallas") and a call site ran "reference" or "blockwise" for the platform, or a
T x T tensor is present, or no call site logged what auto chose (the check would be blind). Schemes without a fused path report what they use and pass.

`--force_auto` (default on) sets model.attention_impl="auto" (configs/default.py's default),
saying so in a note line when the config named another impl: that is what the check is for. With --noforce_auto the config's impl is lowered as it is, with a warning line; no
call site is logged then, and "reference" or "blockwise" for a scheme with a fused path fails.
`--config` is required. A bad flag or config value is one line and exit 1. The step is built
over this host's devices as the config's mesh asks (one CPU device: every axis 1); a config
whose mesh names more devices needs them simulated,
XLA_FLAGS=--xla_force_host_platform_device_count=N (on a sequence mesh "auto" is "ring").
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import re
import sys
from collections import Counter

import jax
from absl import app, flags
from ml_collections import config_flags

from data import pipeline
from lab import cli
from lab.lowering import CUDNN, MOSAIC, TRITON, UNSTABLE_CALLS, simplified, target
from lab.state import abstract_train_step, check_config, mesh_and_batch, model_config
from models.registry import make_scheme
from positional.attention import FACTS, REFERENCE_MAX

FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_enum("platform", "tpu", ["tpu", "cuda"], "the platform lowered for", flag_values=FLAGS)
flags.DEFINE_bool("force_auto", True, "set model.attention_impl='auto' (a note line when the config "
                  "named another); --noforce_auto lowers the config's impl, with a warning line", flag_values=FLAGS)
# No default: ml_collections would apply --config.x overrides to a default while defining the
# flag, where a bad one is a traceback rather than parse_flags's one line.
config_flags.DEFINE_config_file("config", None, "experiment config: configs/<file>.py[:arg] (required)",
                                flag_values=FLAGS, lock_config=False, accept_new_attributes=True)

KINDS = {"triton": "triton", "mosaic": "mosaic (tpu_custom_call)", "cudnn": "cudnn fmha"}
FALLBACKS = ("reference", "blockwise")
BYTES = {"i1": 1, "i8": 1, "ui8": 1, "i16": 2, "ui16": 2, "bf16": 2, "f16": 2, "i32": 4, "ui32": 4, "f32": 4,
         "i64": 8, "ui64": 8, "f64": 8, "f8E4M3FN": 1, "f8E5M2": 1}


# ---- lowering on a CPU host ----------------------------------------------------------------

def _layer_of_caller() -> int | None:
    """The index of the model block being traced (DecoderLM.__call__'s loop), if any."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "__call__" and type(frame.f_locals.get("self")).__name__ == "DecoderLM":
            i = frame.f_locals.get("i")
            return i if isinstance(i, int) else None
        frame = frame.f_back
    return None


class _Choices(logging.Handler):
    """Collects the dispatcher's per-call-site DEBUG records: (label, platform, impl, why, layer)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[tuple] = []

    def emit(self, record):
        if record.levelno == logging.DEBUG and hasattr(record, "impl"):
            self.records.append((record.label, record.platform, record.impl, record.why, _layer_of_caller()))


@contextlib.contextmanager
def captured_choices():
    log = logging.getLogger("positional.attention")
    handler, level, propagate = _Choices(), log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False  # the records are reported here, not printed by the root logger's handlers
    try:
        yield handler.records
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def lowered_train_step(config, platform: str, devices=None) -> tuple[str, list[tuple], list, object]:
    """(StableHLO text of the config's train step for `platform`, the dispatcher's records, the
    parameters' shapes, the jax Lowered to compile or None). Exported with jax.export over this
    host's devices, or, given `devices` (a TPU topology's), lowered by jit for them, compilable.
    Everything is abstract: nothing is allocated."""
    step, args, mesh = abstract_train_step(config, vocab_size(config), devices, pipeline.batch_keys(config.data))
    with target(platform, mesh=mesh), captured_choices() as records:
        if devices is None:
            checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in UNSTABLE_CALLS]
            lowered, text = None, jax.export.export(step, platforms=[platform], disabled_checks=checks)(*args).mlir_module()
        else:
            lowered = step.lower(*args)
            text = lowered.as_text()
    param_shapes = [tuple(x.shape) for x in jax.tree.leaves(args[0]["params"])]
    return simplified(text), records, param_shapes, lowered


def vocab_size(config) -> int:
    """The model's vocabulary without preparing data: a sentencepiece tokenizer not trained yet
    would be trained first, so its configured size stands in (only shapes matter here)."""
    if config.model.vocab_size:
        return config.model.vocab_size
    if config.data.get("tokenizer") == "sentencepiece":
        return config.data.spm_vocab_size
    return pipeline.tokenizer(config.data).vocab_size


# ---- reading the module --------------------------------------------------------------------

def _kind(target: str) -> str | None:
    if target == TRITON:
        return "triton"
    if target == MOSAIC:
        return "mosaic"
    return "cudnn" if target.startswith(CUDNN) else None


def custom_calls(text: str) -> tuple[dict[str, int], dict[str, int]]:
    """Fused-attention custom calls by kind: (per step, each function's calls counted once per
    call of it from @main; in the module text). A loop body counts once."""
    functions, name = {}, None
    for line in text.splitlines():
        head = re.match(r'\s*func\.func\s+(?:public\s+|private\s+)?@"?([\w$.\-]+)', line)
        if head:
            name = head[1]
            functions[name] = (Counter(), Counter())
        if name is None:
            continue
        for call in re.findall(r'custom_call\s*@"?([\w$.\-]+)', line):
            if _kind(call):
                functions[name][0][_kind(call)] += 1
        # `func.call`, printed `call` inside a function once the module has been through MLIR.
        for callee in re.findall(r'(?<![\w.])(?:func\.)?call\s+@"?([\w$.\-]+)', line):
            functions[name][1][callee] += 1

    totals: dict[str, Counter] = {}

    def total(fn: str) -> Counter:
        if fn not in totals:
            totals[fn] = Counter()  # a recursive call (none in StableHLO) counts nothing more
            own, calls = functions.get(fn, (Counter(), Counter()))
            out = Counter(own)
            for callee, n in calls.items():
                for kind, m in total(callee).items():
                    out[kind] += n * m
            totals[fn] = out
        return totals[fn]

    kinds = ("triton", "mosaic", "cudnn")
    per_step = total("main") if "main" in functions else sum((f[0] for f in functions.values()), Counter())
    in_text = sum((f[0] for f in functions.values()), Counter())
    return {k: per_step[k] for k in kinds}, {k: in_text[k] for k in kinds}


TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-zA-Z]\w*)>")
def module_lines(text: str) -> list[str]:
    """The module's lines with string attributes emptied (a kernel's serialized body)."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', lambda m: m[0] if re.fullmatch(r'"stablehlo\.\w+"', m[0]) else '""',
                  text).splitlines()


def tensor_types(lines: list[str]) -> set[tuple[tuple[int, ...], str]]:
    """Every ranked tensor type of the module, (shape, dtype)."""
    return {(tuple(int(d) for d in dims.split("x")[:-1]), dtype) for line in lines for dims, dtype in TENSOR.findall(line)}


def nbytes(shape, dtype) -> int:
    return math.prod(shape) * BYTES.get(dtype, 4)


def is_t_by_t(shape, seq_len: int, vocab: int, param_shapes: set) -> bool:
    """Two axes of at least seq_len, not a parameter's shape, the logits' vocab axis not counted."""
    if tuple(sorted(shape)) in param_shapes:
        return False
    long = [d for d in shape if d >= seq_len]
    if len(shape) <= 3 and vocab in long:
        long.remove(vocab)
    return len(long) >= 2


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"


def fmt_tensor(shape, dtype) -> str:
    return f"tensor<{'x'.join(map(str, shape))}x{dtype}> ({fmt_bytes(nbytes(shape, dtype))})"


def layers_text(layers) -> str:
    known = sorted({i for i in layers if i is not None})
    if not known:
        return ""
    runs, start = [], known[0]
    for a, b in zip(known, known[1:] + [None]):
        if b != a + 1:
            runs.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return f" (layer{'s' if len(known) > 1 else ''} {', '.join(runs)})"


# ---- the check -----------------------------------------------------------------------------

def configured(flag_values=FLAGS):
    """The config of the flags, its overrides checked (a typo is one ValueError line)."""
    flag = flag_values["config"]
    if flag_values.config is None:
        raise ValueError("pass --config configs/<file>.py[:arg], e.g. --config configs/default.py:alibi")
    cli.check_overrides(config_flags.get_config_filename(flag), config_flags.get_override_values(flag))
    return flag_values.config


def check(config, platform: str, force_auto: bool = True, devices=None) -> dict:
    """Lower `config`'s train step for `platform` (over `devices`, see lowered_train_step), print
    the report; returns it as a dict whose 'failure' is the one line to exit with (None: the
    check passed) and whose 'lowered' compiles it (given devices)."""
    lines = []
    impl = config.model.attention_impl
    if impl != "auto" and force_auto:
        lines.append(f"note: model.attention_impl={impl!r} replaced by 'auto' (--force_auto)")
        config.model.attention_impl = impl = "auto"
    elif impl != "auto":
        lines.append(f"warning: model.attention_impl={impl!r}: 'auto' was not selected, so this lowers "
                     f"{impl!r} and shows no choice of auto's")
    check_config(config)
    seq_len, vocab = config.seq_len, vocab_size(config)
    cfg = model_config(config, vocab)
    scheme = make_scheme(cfg.scheme, num_heads=cfg.num_heads, head_dim=cfg.resolved_head_dim, **dict(cfg.scheme_options))
    label, fused = type(scheme).__name__, "pallas" in scheme.impls
    lines.insert(0, f"lowering {config.model.scheme} ({label}) for {platform}: batch {config.batch_size} x "
                    f"seq_len {seq_len}, d_model {cfg.d_model}, {cfg.num_layers} layers, {cfg.num_heads} heads "
                    f"(kv {cfg.resolved_kv_heads}) x {cfg.resolved_head_dim}, model.dtype {cfg.dtype}, attention_impl {impl}, "
                    f"jax {jax.__version__}")
    lines.append(f"fused path: {'yes' if fused else 'no'} ({label} impls: {', '.join(scheme.impls)})")

    text, records, param_shapes, lowered = lowered_train_step(config, platform, devices)
    sequence = mesh_and_batch(config, devices)[0].shape["sequence"]

    mine = [r for r in records if r[1] == platform]
    sites: dict[tuple, list] = {}
    for label_, _, chosen, why, layer in mine:
        sites.setdefault((label_ or "?", chosen, why), []).append(layer)
    lines.append(f"call sites (auto on {platform}; identical lines counted once, a reused trace once):")
    if sites:
        for (label_, chosen, why), layers in sites.items():
            lines.append(f"  {len(layers)} x {label_}{layers_text(layers)}: {chosen} -- {why}")
    elif impl == "auto" and "auto" not in scheme.impls and "ring" in scheme.impls and sequence > 1:
        lines.append(f"  {label} has its own attention (impls {', '.join(scheme.impls)}): auto is its "
                     f"'ring' on the sequence mesh ({sequence} devices)")
    elif impl == "auto" and "auto" not in scheme.impls:
        own = "reference" if seq_len <= REFERENCE_MAX else "blockwise"
        lines.append(f"  {label} has its own attention (impls {', '.join(scheme.impls)}): auto is its "
                     f"{own!r}, by length ({seq_len} keys {'<=' if own == 'reference' else '>'} {REFERENCE_MAX})")
    elif impl != "auto":
        lines.append(f"  none logged: every call site runs {impl!r}")
    else:
        lines.append("  none: no attention call site was traced")

    calls, in_text = custom_calls(text)
    shown = ", ".join(f"{name} {calls[k]}" for k, name in KINDS.items())
    text_note = "" if calls == in_text else f" ({', '.join(f'{k} {in_text[k]}' for k in KINDS)} in the text)"
    lines.append(f"fused custom calls per step: {shown}{text_note}")
    types = tensor_types(module_lines(text))
    lines.append(f"largest tensor: {fmt_tensor(*max(types, key=lambda t: (nbytes(*t), t)))}")
    params = {tuple(sorted(s)) for s in param_shapes}
    square = sorted((t for t in types if is_t_by_t(t[0], seq_len, vocab, params)), key=lambda t: -nbytes(*t))
    found = f"yes, {len(square)} shape(s), largest {fmt_tensor(*square[0])}" if square else "none"
    lines.append(f"T x T tensor (two axes >= {seq_len}): {found}")

    failure = None
    if fused:
        fell = [(lab, chosen, why, layers) for (lab, chosen, why), layers in sites.items() if chosen in FALLBACKS]
        measured = [f for f in fell if any(str(fact) in f[2] for fact in FACTS.values())]
        for lab, chosen, why, layers in measured:  # a choice a measurement made: intended, said so
            lines.append(f"note: {lab} runs {chosen!r} on {platform} by a measured choice "
                         f"(positional.attention.FACTS): {why}")
        fell = [f for f in fell if f not in measured]
        if fell:
            lab, chosen, why, layers = fell[0]
            more = f" (and {len(fell) - 1} more line(s))" if len(fell) > 1 else ""
            failure = (f"{config.model.scheme} ({lab}) fell back to {chosen!r} on {platform} at "
                       f"{len(layers)} call site(s){layers_text(layers)}: {why}{more}")
        elif impl in FALLBACKS:
            failure = (f"{config.model.scheme} ({label}) runs {impl!r} on {platform} (model.attention_impl, "
                       f"auto not selected) although it has a fused path")
        elif impl == "auto" and "auto" in scheme.impls and not sites:
            failure = (f"{config.model.scheme} ({label}): no attention call site logged what auto chose, so "
                       "the check cannot tell what runs; every auto path must log its choice (positional/attention.py)")
        if failure is None and square:
            failure = (f"{config.model.scheme} ({label}) has a fused path but the step lowered for {platform} "
                       f"holds a T x T tensor {fmt_tensor(*square[0])}")
        if failure and square and "T x T" not in failure:
            failure += f"; T x T tensor {fmt_tensor(*square[0])}"
    lines.append(f"result: {'FAIL' if failure else 'ok'}")
    print("\n".join(lines), flush=True)
    return {"platform": platform, "scheme": config.model.scheme, "label": label, "fused_path": fused,
            "sites": sites, "custom_calls": calls, "t_by_t": square, "failure": failure, "lines": lines,
            "lowered": lowered}


def benchmark() -> dict:
    """The check FLAGS ask for (see `check`)."""
    return check(configured(), FLAGS.platform, FLAGS.force_auto)


def main_of(benchmark):
    """The main(argv) of a check script (this one, benchmarks/compile.py): flags only, benchmark()
    through cli.run_cli, and each failure it returns (a result's 'failure', or a list of them) one
    'error:' line on stderr, then exit 1."""
    def main(argv):
        if len(argv) > 1:
            print(f"error: unexpected arguments {argv[1:]}; flags only", file=sys.stderr)
            sys.exit(1)
        cli.quiet()
        result = cli.run_cli(benchmark)
        failures = result if isinstance(result, list) else [result["failure"]] if result else []
        for failure in filter(None, failures):
            print(f"error: {failure}", file=sys.stderr)
        if any(failures):
            sys.exit(1)
    return main


main = main_of(benchmark)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
