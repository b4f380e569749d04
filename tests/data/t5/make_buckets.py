"""Write tests/data/t5/buckets.json, the fixture of tests/positional/test_t5.py: T5's causal
distance buckets as transformers computes them (needs transformers < 5, whose Flax T5 holds
the bucketing as a static method, and jax: `pip install "transformers<5" flax` in a separate
environment).

    python tests/data/t5/make_buckets.py

For each (num_buckets, max_distance), the first distance of every bucket over distances
0 .. LAST (buckets grow with the distance, so these starts give every distance's bucket).
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from transformers.models.t5.modeling_flax_t5 import FlaxT5Attention

LAST = 20_000
SETTINGS = ((32, 128), (64, 256), (8, 20))


def main():
    distance = np.arange(LAST + 1)
    out = {"last": LAST, "starts": {}}
    for num_buckets, max_distance in SETTINGS:
        # relative position = key - query = -distance; the decoder's bucketing (bidirectional=False)
        buckets = np.asarray(FlaxT5Attention._relative_position_bucket(
            jnp.asarray(-distance), bidirectional=False, num_buckets=num_buckets, max_distance=max_distance))
        assert np.all(np.diff(buckets) >= 0)
        starts = [int(np.argmax(buckets == b)) for b in range(num_buckets)]
        out["starts"][f"{num_buckets},{max_distance}"] = starts
    with open(os.path.join(os.path.dirname(__file__), "buckets.json"), "w") as f:
        json.dump(out, f)
        f.write("\n")


if __name__ == "__main__":
    main()
