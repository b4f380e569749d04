"""The test harness's own guards (tests/conftest.py with tests/helpers/maps.py)."""

import gc
import mmap

import jax
import jax.numpy as jnp

from helpers import maps


def test_clearing_jaxs_caches_gives_back_its_programs_memory_maps():
    """What `release_programs` relies on: each loaded XLA:CPU program holds memory maps until
    JAX's caches let it go."""
    fns = [jax.jit(lambda x, i=i: x * i + 1.5) for i in range(100)]
    before = maps.memory_maps()
    for f in fns:
        f(jnp.ones(3)).block_until_ready()
    grown = maps.memory_maps() - before
    jax.clear_caches()
    gc.collect()
    assert grown >= 200 and maps.memory_maps() - before < grown / 4, (grown, maps.memory_maps() - before)


def test_a_process_over_half_the_map_limit_clears_jaxs_caches():
    f = jax.jit(lambda x: x * 2.5)
    f(jnp.ones(3)).block_until_ready()
    limit = 2 * maps.memory_maps() + 2000
    assert not maps.release_programs(limit) and f._cache_size() == 1
    # over half of it: maps of alternating protection, which the kernel cannot merge
    held = [mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | (i % 2) * mmap.PROT_WRITE) for i in range(2000)]
    try:
        assert maps.release_programs(limit) and f._cache_size() == 0
    finally:
        for m in held:
            m.close()
