"""T5's bucketed distance bias (positional/t5.py) against transformers' bucketing (a shipped
fixture, tests/data/t5/buckets.json, made by tests/data/t5/make_buckets.py). The conformance
suite checks the scheme itself (every implementation, the fused kernel's table gradient
included) with no code here."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from models.registry import make_scheme
from positional.t5 import bucket

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "data", "t5", "buckets.json")


def test_buckets_equal_transformers_at_every_distance():
    with open(FIXTURE) as f:
        fixture = json.load(f)
    distance = np.arange(fixture["last"] + 1)
    for setting, starts in fixture["starts"].items():
        num_buckets, max_distance = map(int, setting.split(","))
        want = np.searchsorted(starts, distance, side="right") - 1
        for d in (distance, distance.astype(np.float32)):  # positions reach the bias as fp32 values
            np.testing.assert_array_equal(bucket(jnp.asarray(d), num_buckets, max_distance), want, err_msg=setting)


def test_the_bias_is_the_table_at_the_bucket_and_keys_after_the_query_read_bucket_0():
    scheme = make_scheme("t5", num_heads=2, head_dim=8, num_buckets=8, max_distance=20)
    table = jnp.arange(16.0).reshape(2, 8)
    pos = jnp.asarray([[0, 3, 9, 30]])
    got = scheme.bias_fn({"t5_table": table}, pos)(jnp.arange(4), jnp.arange(4))[0]  # [H, 4, 4]
    d = np.maximum(np.asarray(pos[0])[:, None] - np.asarray(pos[0])[None, :], 0)
    np.testing.assert_array_equal(got, np.asarray(table)[:, np.asarray(bucket(d, 8, 20))])
    assert got[1, 3, 0] == 15.0 and got[0, 0, 3] == 0.0  # distance 30 > max_distance: the last bucket


def test_bad_bucket_settings_are_one_line():
    with pytest.raises(ValueError, match="num_buckets / 2 < max_distance") as raised:
        make_scheme("t5", num_heads=2, head_dim=8, num_buckets=64, max_distance=16)
    assert "\n" not in str(raised.value)
