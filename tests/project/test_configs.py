"""The config files: the one argument grammar (configs/__init__.py), and experiment configs that
reuse another experiment's runs match it in everything else."""

import importlib

import pytest

from configs import SCHEME, accumulated, default, demo, long_context, parse_arg, sessa, tapa
from helpers.tiny_setup import cli


@pytest.mark.parametrize("family,scheme", [("espr", "rope"), ("path", "rope"), ("path", "so2_learned_qkv")])
def test_config_matches_the_accumulated_config_so_its_runs_serve(family, scheme):
    a = importlib.import_module(f"configs.{family}").get_config(scheme).to_dict()
    b = accumulated.get_config(scheme).to_dict()
    assert a.pop("workdir") != b.pop("workdir")
    assert a == b


CONFIGS = ("default", "demo", "accumulated", "espr", "path", "tapa", "sessa", "long_context")


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_file_declares_its_fields_and_parses_its_defaults(name):
    module = importlib.import_module(f"configs.{name}")
    defaults = "/".join(str(default) for _, default, _ in module.FIELDS)
    assert module.get_config().to_dict() == module.get_config(defaults).to_dict()


@pytest.mark.parametrize("name,arg,field", [
    ("default", "bogus", "scheme"), ("demo", "rope,fast", "scheme"), ("demo", "rope/slow", "size"),
    ("accumulated", "so2_learned_qkv+bogus", "scheme"), ("espr", "bogus", "scheme"), ("path", "bogus", "scheme"),
    ("tapa", "train/rope", "stage"), ("tapa", "pretrain/yarn", "method"), ("tapa", "extend/tapa_x", "method"),
    ("sessa", "foo/sessa", "task"), ("sessa", "symbolsoup/lstm", "mixer"), ("sessa", "symbolsoup/sessa/x", "seed"),
    ("long_context", "gpu4/rope", "hardware"), ("long_context", "gpu8/bogus", "scheme"),
])
def test_a_bad_field_gives_one_line_naming_it(name, arg, field):
    module = importlib.import_module(f"configs.{name}")
    with pytest.raises(ValueError) as error:
        module.get_config(arg)
    grammar = "/".join(f[0].upper() for f in module.FIELDS)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"configs/{name}.py:{arg}: {field} ")
    assert f"the argument is {grammar}" in message


def test_the_documented_arguments_keep_their_meaning():
    assert demo.get_config("rope/fast").workdir == "runs/demo-fast/rope"
    assert demo.get_config("alibi").workdir == "runs/demo/alibi"
    assert sessa.get_config("symbolsoup/sessa/1").seed == 1
    assert tapa.get_config("pretrain/tapa").workdir == "runs/tapa/pretrain/tapa"
    assert tapa.get_config("extend/yarn").model.scheme_options.scaling == "yarn"
    assert long_context.get_config("gpu8/rope").workdir == "runs/long_context/gpu8-rope"
    assert default.get_config("so2_learned_qkv+alibi").model.scheme == "so2_learned_qkv+alibi"


FIELDS = (("task", "a", ("a", "b")), ("size", "big", lambda f: ("big",) if f["task"] == "a" else ("big", "small")),
          ("seed", 0, int), ("scheme", "rope", SCHEME))


@pytest.mark.parametrize("arg,expected", [
    (None, dict(task="a", size="big", seed=0, scheme="rope")),
    ("", dict(task="a", size="big", seed=0, scheme="rope")),
    ("b", dict(task="b", size="big", seed=0, scheme="rope")),
    ("b/small/3", dict(task="b", size="small", seed=3, scheme="rope")),
    ("a//2/so2_learned_qkv+alibi", dict(task="a", size="big", seed=2, scheme="so2_learned_qkv+alibi")),
])
def test_parse_arg_fills_trailing_and_empty_fields_with_defaults(arg, expected):
    assert parse_arg("configs/x.py", arg, FIELDS) == expected


@pytest.mark.parametrize("arg,error", [
    ("c", "configs/x.py:c: task 'c' is not valid (valid: a, b); "),
    ("a/small", "configs/x.py:a/small: size 'small' is not valid (valid: big); "),  # depends on task
    ("a/big/-1", "configs/x.py:a/big/-1: seed '-1' is not valid (valid: a non-negative integer); "),
    ("a/big/0/rope+bogus", "configs/x.py:a/big/0/rope+bogus: scheme 'rope+bogus' is not valid (valid: a registered "
                           "scheme, '+' adding a bias: alibi,"),
    ("a/big/0/rope/x", "configs/x.py:a/big/0/rope/x: 5 fields, at most 4; "),
])
def test_parse_arg_names_the_field_the_value_and_the_grammar(arg, error):
    with pytest.raises(ValueError) as raised:
        parse_arg("configs/x.py", arg, FIELDS)
    assert str(raised.value).startswith(error)
    assert str(raised.value).endswith("the argument is TASK/SIZE/SEED/SCHEME (default a/big/0/rope)")


def test_a_bad_config_argument_on_the_command_line_is_one_line():
    run = cli("train.py", "--config", "configs/sessa.py:foo/sessa")
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        "error: configs/sessa.py:foo/sessa: task 'foo' is not valid (valid: symbolsoup, symbolsoup_full, mqar, "
        "lm); the argument is TASK/MIXER/SEED (default symbolsoup/sessa/0)"]
