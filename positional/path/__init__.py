"""PaTH: attention along an accumulated product of data-dependent Householder transforms, all
in this folder: the reference beside the fast forms, each tested against it
(tests/positional/test_path.py, tests/positional/test_path_kernel.py, tests/positional/test_ring.py).

Each token t emits a unit vector w_t and a gain beta_t in (0, 2): H_t = I - beta_t w_t w_t^T
(orthogonal when beta_t = 2, the identity when beta_t = 0). The logit of query i on key j is

    s_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(D)                    (the route (j, i])

Route convention, as in PaTH (Yang et al. 2025): the route from key j to query i holds the
steps of tokens j+1..i, the query's own step included and the key's excluded, so a key is
carried forward by every token that arrives after it. The accumulated-transformations paper
writes routes as the steps of tokens j..i-1 (P_{j->i} = M_{i-1}^{-1} ... M_j^{-1}); the two
are the same family with the step index shifted by one (its M_{t-1}^{-1} is our H_t), which
only changes which token's hidden state emits a step. Values are not transported.

Modules, bottom up (each imports only those above it in this list):
  transport  the algebra: H_t, the UT transform (H_n ... H_1 = I - W^T U W with U = (I +
             diag(beta) L)^-1 diag(beta), L the strictly lower part of W W^T; a contiguous range
             of steps uses the diagonal block of the same U), chunks' D x D products and their
             prefix / suffix products (`jax.lax.associative_scan`), keys carried to the end
             (a decode cache prefilled in parallel); the inputs' checks;
  reference  obviously correct: the dense route products P[i, j] [T, T, D, D] (small T only)
             and the materialised logits `path_scores` (O(T^2) memory; one UT solve per chunk);
  kernel     the Pallas kernel (GPU and TPU), forward and recomputing backward, per block of
             `span` tokens where asked; it imports no other scheme file;
  across     the routes between blocks as plain flash attention (a Pallas kernel, forward and
             dq / dk-dv kernels parallel over tiles) once each query is carried back to the end
             of every earlier block (`versions`, plain JAX), a run of query blocks a call: the
             outer level of two, or with blocks of one chunk the level between a block's chunks;
  chunked    flash-style in plain JAX: keys carried to the end of their chunk, queries carried
             back one chunk at a time, online softmax; O(T * D) memory and a recomputing
             backward (a custom VJP). With `span`, in two levels: the same (or the kernel)
             inside blocks of span tokens and across the blocks, one D x D product per block,
             merged by log-sum-exp; or (`across`) with the across-blocks kernel between the
             blocks, and between each block's chunks too;
  ring       the sequence split over a ring of devices (positional/ring.py's ring with a D x D
             map per visiting shard, the own shard by the chunked form);
  scheme     the `Path` scheme: options, features, the impls and `auto`, decoding.

Shapes: q [B, T, H, D]; k, v, w [B, T, K, D]; beta [B, T, K] (K kv heads, H % K == 0: a
query head reads the transport of its kv head).

PaTH-FoX (`path_fox`) adds FoX's gate sums F_i - F_j (positional/fox.py) on the PaTH authors'
scale: s_ij = (q_i^T P k_j + F_i - F_j) / sqrt(D), as their reference, kernels and decoding
compute it. FoX itself adds F_i - F_j after the 1 / sqrt(D); `path+fox` keeps that convention.
Every algorithm here takes the gate as a score bias, so the scale lives in one place (Fox's
`logit_scale`, fixed by path_fox's registry entry).
"""
