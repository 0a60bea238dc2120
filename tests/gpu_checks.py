"""Shared helpers of the GPU tier: random inputs, and a kernel family checked against the fp32
reference by FlashAttention's tolerance rule (forward, or forward + backward)."""
import numpy as np

import cuflash
from cuflash import reference as ref


def inputs(rng, b, sq, sk, h, hkv, d, dtype):
    """q (b, sq, h, d), k and v (b, sk, hkv, d) from N(0, 1), in ``dtype`` on the GPU."""
    import cupy

    def rand(*shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)

    return rand(b, sq, h, d), rand(b, sk, hkv, d), rand(b, sk, hkv, d)


def rising_maxima_inputs(rng, sq, sk, key_block, late_key, d=128):
    """bf16 q (2, sq, 4, d), k and v (2, sk, 2, d) whose row maxima rise more than 2^8-fold after a row's
    first tiles (for the forward's speculative max): keys key_block .. 2 key_block - 1 scaled 4x and the rest
    16x, and key ``late_key`` aligned with the first 16 query rows of each 128-row block (one warp of a
    consumer), ~70 nats above the rest for them."""
    import cupy

    q, k, v = inputs(rng, 2, sq, sk, 4, 2, d, "bfloat16")
    growth = cupy.asarray(4.0 ** np.minimum(np.arange(sk) // key_block, 2), dtype=cupy.float32)
    k = (k.astype(cupy.float32) * growth[None, :, None, None]).astype(k.dtype)
    u = cupy.asarray(rng.standard_normal(d).astype(np.float32))
    aligned = q.astype(cupy.float32)
    aligned[:, cupy.asarray((np.arange(sq) % 128) < 16)] += 3 * u
    k[:, late_key] = (2 * u).astype(k.dtype)
    return aligned.astype(q.dtype), k, v


def check_forward(impl, q, k, v, *, lse_atol=2e-3, **options):
    """``impl``'s forward (out and LSE) against the reference; ``options``: causal, window_size, softcap,
    alibi_slopes. Returns (out, lse)."""
    out, lse = cuflash.flash_attn_func(q, k, v, return_lse=True, impl=impl, **options)
    o_ref, lse_ref = ref.attention_ref(q, k, v, **options)
    o_low, _ = ref.attention_ref_lowp(q, k, v, **options)
    assert out.dtype == q.dtype and out.shape == q.shape
    ref.check_close("out", out, o_ref, o_low)
    ref.check_close("lse", lse, lse_ref, lse_ref, atol=lse_atol)
    return out, lse


def check_backward(impl, q, k, v, *, deterministic=False, **options):
    """``impl``'s forward + backward, gradients against the reference. Returns (dout, out, lse, grads)."""
    import cupy

    out, lse = cuflash.flash_attn_func(q, k, v, return_lse=True, impl=impl, **options)
    dout = cupy.asarray(np.random.default_rng().standard_normal(q.shape, dtype=np.float32)).astype(q.dtype)
    bwd_options = dict(options, deterministic=True) if deterministic else options
    grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, impl=impl, **bwd_options)
    grads_ref = ref.attention_ref_backward(dout, q, k, v, **options)
    grads_low = ref.attention_ref_backward_lowp(dout, q, k, v, **options)
    for name, g, g_ref, g_low, like in zip(("dq", "dk", "dv"), grads, grads_ref, grads_low, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype
        ref.check_close(name, g, g_ref, g_low)
    return dout, out, lse, grads


def varlen_batch(rng, lens_q, lens_k, h, hkv, d, dtype="bfloat16", extra_rows=3):
    """Packed inputs with a few unused rows at the end (they belong to no sequence)."""
    import cupy

    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)

    def rand(*shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)

    q = rand(int(cu_q[-1]) + extra_rows, h, d)
    k = rand(int(cu_k[-1]) + extra_rows, hkv, d)
    v = rand(int(cu_k[-1]) + extra_rows, hkv, d)
    return q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k), cu_q, cu_k


def varlen_sequences(cu_q, cu_k):
    """(b, q_start, q_end, k_start, k_end) of every sequence with query rows, from host offsets."""
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if qe > qs:
            yield b, qs, qe, ks, ke


def check_varlen_forward(out, lse, q, k, v, cu_q, cu_k, **options):
    """A packed forward's out and lse, sequence by sequence, against the reference run on that sequence
    alone; sequences without keys must give out 0 and lse -inf."""
    for b, qs, qe, ks, ke in varlen_sequences(cu_q, cu_k):
        if ke == ks:
            assert float(abs(out[qs:qe].astype("float32")).max()) == 0.0
            assert bool((lse[:, qs:qe] == -np.inf).all())
            continue
        qb, kb, vb = q[None, qs:qe], k[None, ks:ke], v[None, ks:ke]  # one sequence as a batch of 1
        o_ref, lse_ref = ref.attention_ref(qb, kb, vb, **options)
        o_low, _ = ref.attention_ref_lowp(qb, kb, vb, **options)
        ref.check_close(f"out[{b}]", out[None, qs:qe], o_ref, o_low)
        # tanh.approx.f32 in the capped kernels: the logits, and so the LSE, may be off by ~softcap * 5e-4
        lse_atol = 2e-3 + 1e-3 * options.get("softcap", 0)
        ref.check_close(f"lse[{b}]", lse[None, :, qs:qe], lse_ref, lse_ref, atol=lse_atol)


def check_varlen_backward(impl, rng, lens_q, lens_k, h, hkv, d, *, causal=False, deterministic=False, **options):
    """``impl``'s packed forward and backward (a few unused rows after the last sequence), every sequence's
    out, lse and gradients against the reference run on that sequence alone; sequences without keys give
    dq 0, and the rows after the last sequence stay 0. Returns (dout, out, lse, (dq, dk, dv), offsets) for
    reruns."""
    import cupy

    q, k, v, cu_q, cu_k, hq, hk = varlen_batch(rng, lens_q, lens_k, h, hkv, d)
    max_q, max_k = max(lens_q), max(lens_k)
    out, lse = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True,
                                              impl=impl, **options)
    dout = cupy.asarray(rng.standard_normal(q.shape, dtype=np.float32)).astype(q.dtype)
    bwd_options = dict(options, deterministic=True) if deterministic else options
    grads = cuflash.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=causal,
                                               impl=impl, **bwd_options)
    dq, dk, dv = grads
    check_varlen_forward(out, lse, q, k, v, hq, hk, causal=causal, **options)
    for b, qs, qe, ks, ke in varlen_sequences(hq, hk):
        if ke == ks:
            assert float(abs(dq[qs:qe].astype("float32")).max()) == 0.0
            continue
        qb, kb, vb, dob = q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], dout[None, qs:qe]  # one sequence
        g_ref = ref.attention_ref_backward(dob, qb, kb, vb, causal=causal, **options)
        g_low = ref.attention_ref_backward_lowp(dob, qb, kb, vb, causal=causal, **options)
        for name, g, s, e, gr, gl in (("dq", dq, qs, qe, g_ref[0], g_low[0]), ("dk", dk, ks, ke, g_ref[1], g_low[1]),
                                      ("dv", dv, ks, ke, g_ref[2], g_low[2])):
            ref.check_close(f"{name}[{b}]", g[None, s:e], gr, gl)
    # rows after the last sequence belong to none
    assert float(abs(out[int(hq[-1]):].astype("float32")).max()) == 0.0
    assert float(abs(dq[int(hq[-1]):].astype("float32")).max()) == 0.0
    assert float(abs(dk[int(hk[-1]):].astype("float32")).max()) == 0.0
    return dout, out, lse, grads, (q, k, v, cu_q, cu_k, max_q, max_k)


def with_exp2_emu(monkeypatch, k):
    """Every FA3 forward tile table row with exp2_emu = k (kernels_cu/common/poly_exp2.cuh: one group of
    8 key columns in k of the softmax's exponentials on the FMA pipe) for the rest of the test. (cuflash.fa3
    imports some of the tables by name: the same dicts, so the edits reach it.)"""
    import dataclasses

    from cuflash import heuristics

    for table in heuristics.FA3_FORWARD_TABLES:
        for d, t in list(table.items()):
            monkeypatch.setitem(table, d, dataclasses.replace(t, exp2_emu=k))
