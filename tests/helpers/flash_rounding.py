"""Flash attention as the vendor kernels round it (cuDNN, splash), in plain JAX, to see on this
host what their bf16 steps do to a gradient: the weights P rounded to bf16 before P.V and
P^T.dO, D = rowsum(dO * O) from the bf16 output O, dS = P (dP - D) rounded to bf16 before dS.K
and dS^T.Q, every product accumulated in fp32, and dq, dk, dv returned in the inputs' dtype.
Takes jax.nn.dot_product_attention's arguments (mask, scale, is_causal; GQA), so a test can
patch it in for `implementation="xla"`."""

import jax
import jax.numpy as jnp


def rounded_attention(q, k, v, mask=None, scale=None, is_causal=False, implementation=None, local_window_size=None):
    del implementation
    assert local_window_size is None, "no window here"
    b, t, h, d = q.shape
    g, s = h // k.shape[2], k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    allowed = jnp.ones((1, 1, t, s), bool) if mask is None else mask
    if is_causal:
        allowed = allowed & jnp.tril(jnp.ones((t, s), bool))
    wide = lambda x: jnp.repeat(x, g, axis=2)  # noqa: E731  kv heads -> query heads
    f32 = jnp.float32

    def weights(q, k, allowed):
        logits = jnp.einsum("bthd,bshd->bhts", q, wide(k), preferred_element_type=f32) * scale
        return jax.nn.softmax(jnp.where(allowed, logits, -1e30), axis=-1)

    def forward(q, k, v, allowed):
        p = weights(q, k, allowed)
        out = jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), wide(v), preferred_element_type=f32)
        return out.astype(q.dtype), (q, k, v, allowed, out.astype(q.dtype))

    def backward(res, dout):
        q, k, v, allowed, out = res
        dout = dout.astype(q.dtype)
        p = weights(q, k, allowed)
        rows = jnp.sum(dout.astype(f32) * out.astype(f32), axis=-1).transpose(0, 2, 1)[..., None]
        dp = jnp.einsum("bthd,bshd->bhts", dout, wide(v), preferred_element_type=f32)
        ds = (p * (dp - rows)).astype(q.dtype)
        dq = jnp.einsum("bhts,bshd->bthd", ds, wide(k), preferred_element_type=f32) * scale
        dk = jnp.einsum("bhts,bthd->bshd", ds, q, preferred_element_type=f32) * scale
        dv = jnp.einsum("bhts,bthd->bshd", p.astype(q.dtype), dout, preferred_element_type=f32)
        per_kv = lambda x: x.reshape(b, s, h // g, g, x.shape[-1]).sum(3)  # noqa: E731
        return dq.astype(q.dtype), per_kv(dk).astype(k.dtype), per_kv(dv).astype(v.dtype), None

    attend = jax.custom_vjp(lambda q, k, v, allowed: forward(q, k, v, allowed)[0])
    attend.defvjp(forward, backward)
    return attend(q, k, v, allowed)
