"""Command-line helpers shared by the entry points: the `--config` flag with its override
check, one readable line for expected failures (bad flags included), and quiet logging."""

from __future__ import annotations

import ast
import importlib.util
import os
import signal
import sys
import traceback

import jax
import ml_collections
from absl import flags, logging
from ml_collections import config_flags

from data import DataError
from lab import distributed
from lab.distributed import StartupError
from lab.evaluators import EVALUATORS
from lab.runs import Pending, with_scheme
from lab.training import TrainingError


def define_config_flag(default: str = "configs/default.py"):
    """The `--config file.py[:arg]` flag. New attributes are accepted so that scheme options need
    no placeholder in the config files (--config.model.scheme_options.base=5e5);
    `check_overrides` rejects any other new field."""
    return _defined(lambda: config_flags.DEFINE_config_file(
        "config", default, "the experiment config: a file and its argument (configs/default.py:alibi); any field "
        "is overridden with --config.<field>=<value> (--config.train.steps=500, --config.workdir=runs/x)",
        lock_config=False, accept_new_attributes=True))


def _defined(define):
    """`define()`, a config flag's DEFINE. ml_collections applies the command line's --config.a.b
    overrides there already, so an override under a group the config lacks fails here: one line
    and exit 1, as `parse_flags` does."""
    try:
        return define()
    except KeyError as e:
        _unknown_field(e)


def _unknown_field(e: KeyError):
    print(f"error: unknown config field {str(e.args[0]).replace(chr(10), '; ')}", file=sys.stderr)
    sys.exit(1)


HELP = ("--help", "-h", "-?", "--helpshort", "--helpfull")


def parse_flags(argv):
    """absl's flag parsing (`app.run(main, flags_parser=parse_flags)`), except that a bad flag
    value, such as a config file's argument, is one line and exit 1 instead of a traceback, and
    --help lists the entry point's flags, those defined for it here included, and exits 0."""
    main = sys.argv[0]
    for flag in {id(f): f for f in flags.FLAGS._flags().values()}.values():  # the flags of lab.cli
        if flags.FLAGS.find_module_defining_flag(flag.name) == __name__:
            flags.FLAGS.register_key_flag_for_module(main, flag)
    try:
        return flags.FLAGS(argv)
    except SystemExit:  # absl exits 1 after printing the help it was asked for
        if any(arg in HELP for arg in argv[1:]):
            sys.exit(0)
        raise
    except flags.Error as e:
        # ml_collections hands a config file's exception over as formatted text: its last line.
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        print(f"error: {(lines[-1] if lines else repr(e)).removeprefix('ValueError: ')}", file=sys.stderr)
        sys.exit(1)
    except OSError as e:  # ml_collections: a config file that does not load, reported at its first override
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        print(f"error: --config: cannot load the config file: {lines[-1] if lines else e} (pass one under "
              f"configs/, e.g. --config configs/default.py:rope)", file=sys.stderr)
        sys.exit(1)
    except KeyError as e:  # ml_collections: an override under a group the config lacks (--config.modle.x)
        _unknown_field(e)


def checked_config(flag_holder) -> ml_collections.ConfigDict:
    """The parsed config, after checking its overrides name real fields (one line and exit 1 if not)."""
    flag = flags.FLAGS[flag_holder.name]
    run_cli(lambda: check_overrides(config_flags.get_config_filename(flag),
                                    config_flags.get_override_values(flag)))
    return flag_holder.value


def define_distributed_flags() -> None:
    """Flags that make eval.py or analyze.py one process of several (a cluster launcher JAX detects needs
    none)."""
    flags.DEFINE_string("coordinator", "", "several processes: host:port of process 0 (with --num_processes, "
                        "--process_id, on every host)")
    flags.DEFINE_integer("num_processes", 0, "several processes: how many (0: detected, or one)")
    flags.DEFINE_integer("process_id", -1, "several processes: this one's id (-1: detected)")


def define_scheme_flags() -> None:
    """--scheme and --scheme_options: evaluate runs zero-shot under another scheme (`scheme_runs`;
    analyze.py --untrained's copy keeps the run's own scheme)."""
    flags.DEFINE_string("scheme", "", "evaluate every run zero-shot under this registered scheme, with its own "
                        "parameters (e.g. rope_lm_infinite on a rope run); '': each run's own (a shorthand of --config.model.scheme)")
    flags.DEFINE_list("scheme_options", [], "--scheme's options as name=value, e.g. window=128,global_tokens=4 "
                      "(the run's own scheme options are kept unless named; a shorthand of --config.model.scheme_options.<name>)")


def define_eval_config_flag():
    """--config of eval.py and analyze.py: the evaluators, their options and a zero-shot scheme,
    spelled as in a training config (the same fields): --config.evals=lengths,transport
    --config.eval_options.transport.length=512 --config.model.scheme=rope_lm_infinite
    --config.model.scheme_options.window=128. Values read as Python literals, else as words.
    `eval_config` gives it checked."""
    base = ml_collections.ConfigDict({"evals": "", "eval_options": {name: {} for name in EVALUATORS},
                                      "model": {"scheme": "", "scheme_options": {}}})
    return _defined(lambda: config_flags.DEFINE_config_dict(
        "config", base, "evaluators and their options, as in a training config: --config.evals=NAME,NAME, "
        "--config.eval_options.NAME.OPTION=VALUE; --config.model.scheme / scheme_options.OPTION: a zero-shot "
        "scheme", lock_config=False, accept_new_attributes=True))


EVAL_FIELDS = ("evals", "model.scheme", "model.scheme_options.", "eval_options.")


def eval_config(flag_holder) -> ml_collections.ConfigDict:
    """The --config of `define_eval_config_flag`; ValueError, one line, for a field it does not have."""
    for path in config_flags.get_override_values(flags.FLAGS[flag_holder.name]):
        if not (path in EVAL_FIELDS or path.startswith(EVAL_FIELDS[2:]) and path.count(".") >= 2):
            raise ValueError(f"--config.{path}: not a field here; valid: --config.evals, "
                             "--config.eval_options.<evaluator>.<option>, --config.model.scheme, "
                             "--config.model.scheme_options.<option>")
    return flag_holder.value


def define_loading_flags() -> None:
    """How eval.py and analyze.py load a run's parameters (`lab.runs.load_run`)."""
    flags.DEFINE_enum("param_dtype", "", ["", "float32", "bfloat16"], "the parameters in this dtype as they are "
                      "read (bfloat16: half an fp32 checkpoint's memory; '': as stored)")
    flags.DEFINE_integer("fsdp", 1, "devices each parameter is split over (-1: all of this job's; the other "
                         "devices split the batch); 1: a copy on every device")
    flags.DEFINE_integer("tensor", 1, "devices the heads, MLP and vocabulary are split over")
    flags.DEFINE_enum("dtype", "", ["", "float32", "bfloat16"], "the compute dtype to evaluate in ('': the run's "
                      "model.dtype)")


def loading() -> dict:
    """`lab.runs.load_run`'s options from define_loading_flags' flags."""
    f = flags.FLAGS
    return dict(param_dtype=f.param_dtype or None, fsdp=f.fsdp, tensor=f.tensor, dtype=f.dtype or None)


def scheme_runs(workdirs, scheme: str, options, load: dict | None = None) -> list:
    """The runs the evaluators take (from --workdirs, and --config.model.scheme / scheme_options
    or --scheme / --scheme_options): each a `lab.runs.Pending` with the options `load`
    (`loading()`), or with a scheme each run loaded and rebuilt under it (`lab.runs.with_scheme`;
    all of them in memory at once), its options a dict or name=value texts."""
    options = dict(options) if isinstance(options, (dict, ml_collections.ConfigDict)) else parsed_options(options)
    if not scheme:
        if options:
            raise ValueError("--scheme_options sets options of --scheme; pass --scheme=<registered scheme> too "
                             "(or --config.model.scheme=<registered scheme>)")
        return [Pending(w, **(load or {})) for w in workdirs]
    return [with_scheme(Pending(w, **(load or {})).load(), scheme, options) for w in workdirs]


def parsed_options(option_texts) -> dict:
    """{name: value} of --scheme_options' name=value texts, each value a Python literal or a word,
    as ml_collections reads --config.model.scheme_options.<name>=<value>."""
    options = {}
    for text in option_texts:
        name, _, value = text.partition("=")
        if not name or not value:
            raise ValueError(f"--scheme_options={text} is not name=value; valid: e.g. window=128,global_tokens=4")
        try:
            options[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):  # a word: a string option (scaling=yarn)
            options[name] = value
    return options


def eval_runs(workdirs, config) -> list:
    """`scheme_runs` of eval.py and analyze.py: the zero-shot scheme of --config.model.scheme (else
    --scheme), its options from --scheme_options updated by --config.model.scheme_options, and
    the loading flags."""
    f = flags.FLAGS
    return scheme_runs(workdirs, config.model.scheme or f.scheme,
                       {**parsed_options(f.scheme_options), **config.model.scheme_options}, loading())


def start_processes() -> None:
    """Join the job the distributed flags (or the cluster's environment) describe; nothing for one process."""
    f = flags.FLAGS
    distributed.initialize(dict(coordinator=f.coordinator, num_processes=f.num_processes, process_id=f.process_id))


# Warnings that say nothing to a user: each process logs these three times when a job stops on a signal.
NOISE = ("Reached preemption sync point",)


def quiet() -> None:
    """Warnings and errors only: orbax and absl are chatty at INFO (and NOISE dropped)."""
    logging.set_verbosity(logging.WARNING)
    logging.get_absl_logger().addFilter(lambda record: not any(n in record.getMessage() for n in NOISE))


OPEN_FIELDS = ("model.scheme_options.", "model.mixer_options.", "model.layer_kinds.", "eval_options.")


def config_file(file: str):
    """The config file `file` (configs/X.py) loaded as a module: its get_config, FIELDS, VARIANTS."""
    spec = importlib.util.spec_from_file_location("_config_file", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_overrides(config_path: str, override_paths) -> None:
    """Raise if an override names a field the config file does not have (a typo, say), except
    under the open option dicts (the scheme checks its own options, an evaluator its own)."""
    file, _, arg = config_path.partition(":")
    module = config_file(file)
    base = module.get_config(arg) if arg else module.get_config()
    for path in override_paths:
        if path.startswith(OPEN_FIELDS):
            continue
        node = base
        for key in path.split("."):
            if not isinstance(node, ml_collections.ConfigDict) or key not in node:
                raise ValueError(f"unknown config field {path!r} (from --config.{path}); "
                                 f"see {file} and configs/default.py for the fields")
            node = node[key]


class Interrupted(BaseException):
    """A signal raised as an exception (`raise_on`), so that cleanup runs as for Ctrl-C."""


def raise_on(*signals) -> None:
    """Make these signals raise Interrupted in the main thread, as SIGINT raises KeyboardInterrupt."""
    def handler(signum, frame):
        raise Interrupted(signal.Signals(signum).name)
    for s in signals:
        signal.signal(s, handler)


def run_cli(fn):
    """Run fn(); expected failures print one readable line and exit non-zero, SIGINT outside
    training's loop (which checkpoints) exits 130 (a signal given to `raise_on`: 128 + its number). In a job of several processes every failure
    ends this process at once and the others within seconds (`distributed.end`): an error seen
    in a collective is named after the process that failed, an unexpected one has its traceback."""
    try:
        return fn()
    except (TrainingError, DataError, StartupError, ValueError, OSError) as e:  # OSError: a path, and why it failed
        distributed.end(f"error: {e}", 1)
    except (KeyboardInterrupt, Interrupted) as e:
        name = e.args[0] if isinstance(e, Interrupted) else "SIGINT"
        distributed.end(f"interrupted: {name}", 128 + signal.Signals[name])
    except jax.errors.JaxRuntimeError as e:
        if not distributed.multi():
            raise
        line, named = distributed.why_failed(e)
        distributed.end(line, 1, tell=not named)
    except Exception as e:
        if not distributed.multi():
            raise
        traceback.print_exc()
        distributed.end(f"error: {type(e).__name__}: {distributed.first_line(e)} (traceback above)", 1)


def exit_if_interrupted(summary: dict) -> None:
    """After `lab.training.train`: a run a signal stopped early says where it stopped and exits
    non-zero, so a job scheduler or script (`train.py ... && eval.py ...`) sees it did not finish;
    the code is the shell's for death by that signal (130 SIGINT, 143 SIGTERM)."""
    if summary["interrupted"]:
        print(f"interrupted: {summary['interrupted']} at step {summary['step']}; checkpoint saved at "
              f"step {summary['step']} in {os.path.join(summary['workdir'], 'checkpoints')}. "
              "Rerun the same command to continue.", file=sys.stderr)
        sys.exit(128 + signal.Signals[summary["interrupted"]])


def require_workdirs(workdirs) -> None:
    if not workdirs:
        raise ValueError("pass --workdirs=run1[,run2,...]")
