"""PaTH over a sequence mesh (positional/path/ring.py `ring_path_attention`) against the
reference on meshes of simulated devices (run by tests/positional/test_ring.py in a process of its own,
since the device count is fixed when JAX starts).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/helpers/path_ring_check.py \
        '[{"sequence": 4}, {"sequence": 8}]' plain,fox,alibi

The reference is the materialised PaTH logits (`dense_score_fn`: one UT solve over the whole
sequence) in `reference_attention`, on one device. Inputs: GQA (4 query heads on 2 kv heads),
three packed documents per row whose boundaries cross shards, gains beta over all of [0, 2]
(so some steps are singular, beta = 1), chunks of at most 4 tokens (a shard of 12 tokens in
three chunks of 4, padded to two groups of two; one of 6 in two of 3). Cases: "plain" (no
bias), "fox" (FoX gates, F_i - F_j at global indices, as `Path.attention` passes them: a
`Bias` holding F), "alibi" (a plain closure over slopes, taken from the log-gates) and "slots"
(a `Bias` of the slots' indices, whose fn reads qi, kj: global positions); a case
ending in "/kernel" runs the own shard by PaTH's kernel (interpreted, 4-token chunks), one in
"/span" the same in two levels (the kernel inside blocks of 8 tokens: a shard of 12 in a whole
block and a part), one in "/across" the two levels with the across-blocks kernel between the
blocks (the queries one block a call). Prints
JSON: per mesh and case the largest difference of the output and of the gradients of
sum(sin(out)) in q, k, v, w, beta and the log-gates, each relative to the largest reference
value; and the shapes of the arrays the compiled program all-gathers (only the n shards' D x D
products may be).
"""

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tiny_setup import sub_mesh
from positional.attention import reference_attention
from positional.fox import forget_bias
from positional.logits import Bias
from positional.path.reference import dense_score_fn
from positional.path.ring import ring_path_attention

B, T, H, K, D, CHUNK = 2, 48, 4, 2, 8, 4
NAMES = ("q", "k", "v", "w", "beta", "log_forget")


def inputs():
    keys = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(keys[0], (B, T, H, D))
    k, v, w = (jax.random.normal(kk, (B, T, K, D)) for kk in keys[1:4])
    beta = jax.random.uniform(keys[4], (B, T, K), minval=0.0, maxval=2.0)
    log_forget = -jax.nn.softplus(jax.random.normal(keys[5], (B, T, H)))
    return q, k, v, w / jnp.linalg.norm(w, axis=-1, keepdims=True), beta, log_forget


def bias(case, log_forget):
    case = case.split("/")[0]
    if case == "fox":
        return forget_bias(log_forget)
    if case == "slots":  # slopes [1, 1, H] as the Bias's value; the slots' indices as positions, in a bias
        # that a shift of both changes (so a shard's must be its global ones)
        return Bias(lambda q, k, qi, kj: q["slope"] * 4 * jnp.abs(qi - kj) / (1.0 + qi), {"slope": log_forget[:1, :1]})
    if case == "alibi":  # a plain closure, over slopes log_forget[0, 0] < 0 (one per head)
        return lambda qi, kj: log_forget[0, 0][None, :, None, None] * jnp.abs(qi[:, None] - kj[None, :])
    return None


def reference(q, k, v, w, beta, log_forget, *, case, segment_ids):
    return reference_attention(q, k, v, segment_ids=segment_ids, score_fn=dense_score_fn(w, beta, D ** -0.5),
                               bias_fn=bias(case, log_forget))


def ring(mesh):
    def attend(q, k, v, w, beta, log_forget, *, case, segment_ids):
        own = case.partition("/")[2]
        kernel = {"interpret": True, "block_size": CHUNK} if own else None
        return ring_path_attention(q, k, v, w, beta, mesh=mesh, bias_fn=bias(case, log_forget),
                                   segment_ids=segment_ids, chunk=CHUNK, group=2, kernel=kernel,
                                   span=8 if own in ("span", "across") else None,
                                   across="blocks" if own == "across" else "scan", outer_group=1)
    return attend


def loss_and_grads(attend, args, **kw):
    def loss(*args):
        out = attend(*args, **kw)
        return jnp.sum(jnp.sin(out)), out
    compiled = jax.jit(jax.value_and_grad(loss, range(len(args)), has_aux=True)).lower(*args).compile()
    return compiled(*args), compiled.as_text()


def main(meshes, cases):
    # Three documents per row: boundaries at 5 and 30 cross the shards (of 12 or 6 tokens).
    packed = jnp.asarray(np.repeat([[1] * 5 + [2] * 25 + [3] * 18], B, axis=0), jnp.int32)
    args = inputs()
    out = {}
    for sizes in meshes:
        mesh, mesh_name = sub_mesh(sizes)
        for case in cases:
            kw = dict(case=case, segment_ids=packed)
            ((_, want), want_grads), _ = loss_and_grads(reference, args, **kw)
            ((_, got), got_grads), hlo = loss_and_grads(ring(mesh), args, **kw)
            rel = lambda a, b: float(jnp.abs(a - b).max() / jnp.abs(b).max())  # noqa: E731
            result = {"out": rel(got, want)}
            for name, a, b in zip(NAMES, got_grads, want_grads):
                if name != "log_forget" or not case.startswith("plain"):
                    result[name] = rel(a, b)
            result["gathered"] = sorted(set(re.findall(r"= f32\[([\d,]*)\][^ ]* all-gather\(", hlo)))
            out[f"{mesh_name} {case}"] = result
    print(json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2].split(","))
