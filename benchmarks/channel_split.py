"""Why the per-key bias channels failed the GPU check on an H200 (2026-11-27), reproduced here:
the check's FoX and ALiBi cases (gpu_check.py's inputs) through cuDNN's call with XLA in its
place, bf16, the channels as built and with a channel dropped, against the fp32 reference.
The H200 measured out errors 0.2184 (FoX) and 0.0660 (ALiBi): the "old split, GPU" rows (hi
x rounded to bf16, mid and lo zero). XLA on GPU drops an fp32 -> bf16 -> fp32 round trip (excess precision), and
the split computed mid as x - bf16(x); positional.angles.split_bits masks bits instead.

    python benchmarks/channel_split.py
"""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import gpu_check
from models.registry import make_scheme
from positional import vendor
from positional.fox import forget_bias
from positional.softmax import reference_attention


def main():
    b, t, h, kh, d = 2, 1000, 4, 2, 64
    seg = gpu_check.packed_ids(b, t, 3)
    alibi = make_scheme("alibi", num_heads=h, head_dim=d).bias_fn(None, gpu_check.positions_of(seg))
    cases = {"cudnn FoX channels, packed": forget_bias, "cudnn ALiBi channels, packed": lambda lf: alibi}
    for name, bias_of in cases.items():  # inputs as gpu_check.run_check draws them
        keys = jax.random.split(jax.random.key(len(name)), 5)
        q = jax.random.normal(keys[0], (b, t, h, d))
        k, v = (jax.random.normal(x, (b, t, kh, d)) for x in keys[1:3])
        bias = bias_of(jax.nn.log_sigmoid(3 * jax.random.normal(keys[3], (b, t, h))))
        want = reference_attention(q, k, v, bias_fn=bias, segment_ids=seg)
        qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))

        def channels(drop=(), rounded=False):  # channel d + 3 i + c: part c (hi, mid, lo) of head i's term
            qc, kc = vendor.key_bias_channels(qb, kb, bias, segment_ids=seg, scale=d ** -0.5, multiple=8)
            if rounded:  # the old split on a GPU: hi = bf16(x) rounded to nearest, mid = lo = 0
                parts = kc[..., d:d + 3 * (h // kh)].astype(jnp.float32).reshape(*kc.shape[:-1], -1, 3)
                hi = jnp.stack([parts.sum(-1), 0 * parts[..., 0], 0 * parts[..., 0]], -1).astype(kc.dtype)
                kc = kc.at[..., d:d + 3 * (h // kh)].set(hi.reshape(*kc.shape[:-1], -1))
            kc = kc.at[..., np.asarray(drop, int)].set(0) if drop else kc
            vp = jnp.pad(vb, ((0, 0), (0, 0), (0, 0), (0, qc.shape[-1] - d)))
            return vendor.cudnn_call(qc, kc, vp, segment_ids=seg, scale=d ** -0.5, implementation="xla")[..., :d]

        rows = {"as built": channels(), "old split, GPU": channels(rounded=True),
                "hi only": channels((d + 1, d + 2, d + 4, d + 5)),
                "hi + mid": channels((d + 2, d + 5)),
                "no bias": vendor.cudnn_call(qb, kb, vb, segment_ids=seg, implementation="xla")}
        print(name, " ".join(f"{k_}: {gpu_check.rel(v_, want):.4f}" for k_, v_ in rows.items()))


if __name__ == "__main__":
    main()
