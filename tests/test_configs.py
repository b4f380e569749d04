"""Experiment configs that reuse another experiment's runs must match it in everything else."""

import importlib

import pytest

from configs import accumulated


@pytest.mark.parametrize("family,scheme", [("espr", "rope"), ("path", "rope"), ("path", "so2_learned_qkv")])
def test_config_matches_the_accumulated_config_so_its_runs_serve(family, scheme):
    a = importlib.import_module(f"configs.{family}").get_config(scheme).to_dict()
    b = accumulated.get_config(scheme).to_dict()
    assert a.pop("workdir") != b.pop("workdir")
    assert a == b
