"""XLA:CPU loads each program it compiles as about five memory maps, and a process may hold at
most vm.max_map_count maps (65,530 by default). Past that LLVM's loader fails ("Cannot allocate
memory") and XLA crashes the process in its next compile or cache read. A pytest-xdist worker
keeps the programs of hundreds of tests alive in JAX's caches: in `make test` one went from
12,000 to 32,000 maps in under a minute. tests/conftest.py clears JAX's caches after a test
that leaves its process over half the limit (the programs are compiled again, or read back from
the persistent cache, when next used)."""

import gc
import sys
from pathlib import Path

LIMIT_FILE = Path("/proc/sys/vm/max_map_count")
MAP_LIMIT = int(LIMIT_FILE.read_text()) if LIMIT_FILE.exists() else 0


def memory_maps() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


def release_programs(limit: int = MAP_LIMIT) -> bool:
    """Clear JAX's caches if this process holds over half `limit` memory maps; whether it did."""
    if not limit or "jax" not in sys.modules or memory_maps() <= limit // 2:
        return False
    sys.modules["jax"].clear_caches()
    gc.collect()
    return True
