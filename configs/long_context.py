"""Long-context training on real hardware: rows of 131,072 tokens, the sequence split over
devices (models/sharding.py), parameters and optimizer state over fsdp.

    python train.py --config configs/long_context.py:gpu8/rope          # on the 8-GPU host
    python train.py --config configs/long_context.py:gpu8/rope --config.dry_run=True

The dry run compiles the sharded train step and prints each device's memory without
allocating anything; on a machine without the hardware the same plan compiles for simulated
CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, or 16 for tpu16). Variants:

  gpu8    one host with 8 GPUs: mesh sequence=8, 1 row per step
  tpu16   a 16-chip TPU slice: mesh fsdp=2 x sequence=8, 2 rows per step

after the slash, any registered scheme (default rope). The model: d_model 1024, 16 layers,
16 heads of 64 (about 200M parameters), bf16 compute with fp32 parameters and optimizer
state, each block rematerialised, attention "auto": ring attention in 1,024-token blocks on
the sequence mesh (positional/ring.py; PaTH its own ring in 64-token chunks,
positional/path/ring.py `ring_path_attention`, each device's own shard by PaTH's kernel on TPU
where it takes one: with --config.model.scheme_options.span=1024 for tpu16's 16K shards;
espr_rf, which brings its own attention: its chunked form, the keys and values gathered by the
partitioner). Memory per device from the dry run is in benchmarks/RESULTS.md.
"""

from configs import SCHEME, default, parse_arg
from models.registry import config_defaults, make_scheme

HARDWARE = {"gpu8": dict(fsdp=1, sequence=8), "tpu16": dict(fsdp=2, sequence=8)}
FIELDS = (("hardware", "gpu8", HARDWARE), ("scheme", "rope", SCHEME))


def get_config(arg: str | None = None):
    hardware, scheme = parse_arg(__file__, arg, FIELDS).values()
    c = default.get_config(scheme)
    c.model.update(d_model=1024, num_layers=16, num_heads=16, dtype="bfloat16", remat="block")
    # "auto": on the sequence mesh the ring, keys and values passed round in 1,024-token blocks;
    # PaTH's ring keeps its 64-token chunks (its block, config_defaults); espr_rf: its own
    # chunked algorithm, chunk size as configs/default.py sets.
    c.model.attention_impl = "auto"
    if "ring" in make_scheme(c.model.scheme, num_heads=16, head_dim=64).impls and "block_size" not in config_defaults(
            c.model.scheme):
        c.model.block_size = 1024
    c.seq_len = 131072
    c.mesh.update(data=1, tensor=1, **HARDWARE[hardware])
    c.batch_size = HARDWARE[hardware]["fsdp"]  # rows are split over data x fsdp
    c.data.streams = c.batch_size  # a stream per row: each host loads only the rows it holds
    c.train.update(steps=10000, warmup_steps=500, lr=3e-4, checkpoint_every=250, eval_every=0)
    c.workdir = f"runs/long_context/{hardware}-{scheme}"
    return c
