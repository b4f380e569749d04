"""Ring attention against the reference on meshes of simulated devices (run by tests/positional/test_ring.py
in a process of its own, since the device count is fixed when JAX starts).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/helpers/ring_check.py \
        '[{"sequence": 4}, {"data": 2, "sequence": 4}]'

For each mesh and case (GQA, packed documents crossing shard boundaries, an ALiBi-style bias,
a FoX-style bias that reads per-token gates, bf16 inputs, sliding windows of 5 and 11 tokens
with shards of 8), prints JSON: the largest difference
of the output and of the gradients of sum(sin(out)) in q, k, v and the bias parameter, each
relative to the largest reference value, and for cases without a bias ("held") the batch rows
and key/value heads one device holds inside the ring.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tiny_setup import sub_mesh
from positional.attention import reference_attention
from positional.ring import ring_attention

B, T, H, K, D = 2, 32, 4, 2, 8


def alibi_bias(slopes):  # [H] parameter: the bias closes over an array of every head
    return lambda qi, kj: -slopes[None, :, None, None] * jnp.abs(qi[:, None] - kj[None, :]).astype(float)


def fox_bias(log_forget):  # [B, T, H] per-token gates: the bias reads them at global indices
    cum = jnp.moveaxis(jnp.cumsum(log_forget, axis=1), 1, 2)
    return lambda qi, kj: jnp.take(cum, qi, axis=2)[..., :, None] - jnp.take(cum, kj, axis=2)[..., None, :]


SEEN = []  # (batch, key/value heads) of the blocks the score sees: what each device holds


def dot_score(qb, kb, qi, kj):
    SEEN.append((qb.shape[0], kb.shape[2]))
    return jnp.einsum("btkgd,bskd->bkgts", qb, kb, preferred_element_type=jnp.float32) * D ** -0.5


CASES = {  # name -> (bias maker and its parameter's shape, packed, dtype, window); the FoX bias as
    "gqa": (None, False, jnp.float32, None),  # schemes pass theirs, built from the features (`hooks`)
    "packed": (None, True, jnp.float32, None),
    "alibi": ((alibi_bias, (H,)), True, jnp.float32, None),
    "fox": ((fox_bias, (B, T, H)), True, jnp.float32, None),
    "bf16": ((fox_bias, (B, T, H)), True, jnp.bfloat16, None),
    "window": (None, True, jnp.float32, 5),  # shards two apart wholly outside it
    "window_fox": ((fox_bias, (B, T, H)), False, jnp.float32, 11),  # reaching into the shard before
}


def inputs(dtype):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, H, D)).astype(dtype)
    k, v = (jax.random.normal(kk, (B, T, K, D)).astype(dtype) for kk in keys[1:3])
    param = -jax.nn.softplus(jax.random.normal(keys[3], (B, T, H)))  # FoX's log f < 0; slopes: [0]
    return q, k, v, param


def loss_and_grads(attend, q, k, v, param, bias, segment_ids, window):
    def loss(q, k, v, param):
        if bias and bias[0] is fox_bias and attend is not reference_attention:
            hooks = {"hooks": lambda f: (fox_bias(f), None), "features": param}
        else:
            # A new score closure per call: the ring traces it (jax.closure_convert) at one device's
            # block shapes, which SEEN records, and a cached trace would record nothing.
            hooks = {"bias_fn": bias[0](param) if bias else None,
                     "score_fn": None if bias else (lambda *a: dot_score(*a))}
        out = attend(q, k, v, segment_ids=segment_ids, window=window, **hooks)
        return jnp.sum(jnp.sin(out.astype(jnp.float32))), out
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(q, k, v, param)


def main(meshes):
    # Three documents per row: boundaries at 5 and 19 cross the shards of 8 (sequence=4).
    packed = jnp.asarray(np.repeat([[1] * 5 + [2] * 14 + [3] * 13], B, axis=0), jnp.int32)
    out = {}
    for sizes in meshes:
        mesh, mesh_name = sub_mesh(sizes)
        ring = lambda *a, **kw: ring_attention(*a, mesh=mesh, block_size=4, **kw)  # noqa: E731
        for name, (bias, is_packed, dtype, window) in CASES.items():
            q, k, v, param = inputs(dtype)
            if bias:
                param = param if len(bias[1]) == 3 else jnp.abs(param[0, 0])
            segment_ids = packed if is_packed else None
            (_, want), want_grads = loss_and_grads(reference_attention, q, k, v, param, bias, segment_ids, window)
            (_, got), got_grads = loss_and_grads(ring, q, k, v, param, bias, segment_ids, window)
            rel = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()  # noqa: E731
                                     / jnp.abs(b.astype(jnp.float32)).max())
            result = {"out": rel(got, want), "dtype": str(got.dtype)}
            for what, a, b in zip(("dq", "dk", "dv", "dbias"), got_grads, want_grads):
                if what != "dbias" or bias:
                    result[what] = rel(a, b)
            if not bias:
                result["held"] = SEEN[-1]  # the last trace: the ring's
            out[f"{mesh_name} {name}"] = result
    print(json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
