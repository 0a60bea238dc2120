"""64-bit offsets (GPU tier, slow): K and V of more than 2^31 elements give correct results.

K and V are (1, 2^22 + 37, 8, 64) bf16: 2^31 + 18,944 elements each (4.3 GB), so every key row from
BOUNDARY_ROW = 2^31 / (8 * 64) = 4,194,304 on starts past element 2^31 and any 32-bit product of a row
index and a row stride wraps there. A few query rows (seqlen_q = 3) keep the FLOPs small. The same K/V
buffer serves a packed variable-length batch (``flash_attn_varlen_func``) whose last sequence runs
across that boundary. Forward (out, LSE) and backward (dq, dk, dv) are checked, for impl="fa3" (Hopper),
"fa2" and "fa1" (fa1 has no varlen: the packed batch runs on fa3 and fa2), and the decode kernel reads
the same K/V as a KV cache (contiguous, and paged with one row per page, so page numbers times the page
stride pass 2^31 elements).

What makes a wrong offset visible: scores of random data over 4 million keys are flat, so a kernel
that read the wrong rows would still give a plausible-looking average. Each (query row, head) therefore
gets a *needle*: a key row set to BETA * q (score ~ 8 * BETA = 17.6 against ~N(0, 1) for the rest),
which carries 20-99 % of that row's attention weight. Needles sit at the last key, at BOUNDARY_ROW and
just below it, and at random rows, so out, lse, dk and dv all depend on reading and writing the right
rows past 2^31 elements.

The reference runs in float32 CuPy on the same data in chunks of key rows (nothing of size
seqlen_q x seqlen_k or a float32 copy of K is ever whole): an online softmax pass for out and lse,
then a pass for the low-precision reference (the same attention with S, P, dP, dS rounded to bf16, as
``cuflash.reference.attention_ref_lowp`` / ``attention_ref_backward_lowp`` do), then the backward pass,
which compares dk / dv chunk by chunk (the FP8 forward's row: the reference on the dequantised e4m3
values, P rounded to e4m3 in the low-precision pass). Tolerances are FlashAttention's rule as in
``cuflash.reference.check_close``: max |out - ref| <= 2 * max |lowp - ref| + atol. Outputs come from
the poisoned allocator, so an element never written is NaN and fails.

Memory: K, V, dK, dV 4.3 GB each plus ~12 GB of reference temporaries; the tests skip with less than
48 GB free. The seed is printed (``CUFLASH_LARGE_SEED`` replays a run).
"""
import os

import numpy as np
import pytest

import cuflash
from cuflash import reference as ref

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

HEADS, KV_HEADS, D = 16, 8, 64  # GQA 2:1
GROUP = HEADS // KV_HEADS
ROW = KV_HEADS * D  # elements per key row
BOUNDARY_ROW = 2**31 // ROW  # 4,194,304: the first key row that starts at element 2^31
SEQLEN_K = BOUNDARY_ROW + 37  # K and V: 2^31 + 18,944 elements each
SEQLEN_Q = 3
CHUNK = 1 << 19  # key rows per reference step: 1 GiB of float32 per K or V chunk
BETA = 2.2  # needle = BETA * q: its score is BETA * |q|^2 / sqrt(d) ~ 17.6
MIN_FREE_BYTES = 48 << 30
# The kernels add each key tile's exp-sum to one fp32 running sum per row: over 4M keys that is 2^16
# additions of nearly equal increments, each rounded to half an ulp of the running sum, and the rounding
# errors of equal increments do not cancel (measured: FA1 causal, 2.3e-3). The bound is one ulp per tile
# of 64 keys (the smallest BLOCK_N of any family), relative, i.e. absolute on the log. A wrong row offset
# moves the LSE by far more: each needle carries 20-99 % of its row's weight (>= 0.2 on the log).
LSE_ATOL = 1e-3 + (SEQLEN_K / 64) * 2.0**-24

# Packed batch over the same K/V rows: sequence 1 has no keys (its query row sees nothing), the last one
# covers rows 3,000,003 .. SEQLEN_K - 1, across BOUNDARY_ROW.
VARLEN_K = [1_000_003, 0, 2_000_000, SEQLEN_K - 3_000_003]
VARLEN_Q = [2, 1, 3, 1]
VARLEN_EXTRA_Q = 2  # trailing query rows that belong to no sequence (must stay 0)


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _seed():
    seed = int(os.environ.get("CUFLASH_LARGE_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"large-tensor seed: {seed} (CUFLASH_LARGE_SEED={seed} replays it)")
    return seed


@pytest.fixture(scope="module")
def big_kv():
    """(k, v), each (1, SEQLEN_K, KV_HEADS, D) bf16 N(0, 1), filled chunk by chunk (no full fp32 copy)."""
    import cupy

    if not cuflash.available_impls():
        pytest.skip("no cuflash implementation runs on this GPU")
    free, _ = cupy.cuda.runtime.memGetInfo()
    if free < MIN_FREE_BYTES:
        pytest.skip(f"needs {MIN_FREE_BYTES / 2**30:.0f} GiB of free GPU memory; {free / 2**30:.1f} GiB free")
    rng = cupy.random.default_rng(_seed())
    k = cupy.empty((1, SEQLEN_K, KV_HEADS, D), dtype=_bf16())
    v = cupy.empty_like(k)
    for a in (k, v):
        for s in range(0, SEQLEN_K, CHUNK):
            e = min(s + CHUNK, SEQLEN_K)
            a[0, s:e] = rng.standard_normal((e - s, KV_HEADS, D), dtype=cupy.float32).astype(_bf16())
    assert k.size > 2**31 and k.size == 2**31 + 37 * ROW
    yield k, v
    del k, v
    cupy.get_default_memory_pool().free_all_blocks()


def _randn(rng, shape):
    import cupy

    return rng.standard_normal(shape, dtype=cupy.float32).astype(_bf16())


def _plant_needles(q, k, rows):
    """k[rows[i, h], h // GROUP] = BETA * q[i, h] (q: (sq, H, D), k: (rows, Hkv, D) views)."""
    import cupy

    for i in range(q.shape[0]):
        for h in range(q.shape[1]):
            k[int(rows[i, h]), h // GROUP] = (q[i, h].astype(cupy.float32) * BETA).astype(k.dtype)


def _needle_rows(rng, sq, start, stop, special):
    """(sq, HEADS) distinct key rows in [start, stop): the ``special`` ones first, then random ones."""
    want = sq * HEADS
    rows = [int(r) for r in dict.fromkeys(special) if start <= r < stop][:want]
    extra = np.setdiff1d(np.unique(rng.integers(start, stop, size=8 * want)), rows)
    rows += [int(r) for r in rng.permutation(extra)[: want - len(rows)]]
    assert len(rows) == want, "sequence too short for distinct needles"
    return rng.permutation(np.array(rows, dtype=np.int64)).reshape(sq, HEADS)


# ----------------------------------------------------------------------------------------------------
# chunked float32 reference
# ----------------------------------------------------------------------------------------------------

class _Tally:
    """Running FlashAttention-rule comparison of a big output checked chunk by chunk on the GPU."""

    def __init__(self, name):
        self.name, self.err, self.low, self.nonfinite, self.worst = name, 0.0, 0.0, 0, None

    def add(self, got, want, low, row0):
        """got, want, low: (Hkv, C, D) for key rows row0 .. row0 + C - 1."""
        import cupy

        got = got.astype(cupy.float32)
        bad = ~cupy.isfinite(got)
        self.nonfinite += int(bad.sum())
        err = cupy.abs(cupy.where(bad, 0.0, got) - want)
        e = float(err.max())
        if e > self.err:
            g, r, c = (int(x) for x in np.unravel_index(int(err.argmax()), err.shape))
            self.err, self.worst = e, (row0 + r, g, c, float(got[g, r, c]), float(want[g, r, c]))
        self.low = max(self.low, float(cupy.abs(low - want).max()))

    def check(self, atol=1e-3):
        assert self.nonfinite == 0, f"{self.name}: {self.nonfinite} non-finite (unwritten?) elements"
        bound = 2 * self.low + atol
        assert self.err <= bound, (f"{self.name}: max |out - ref| = {self.err:.3e} > allowed {bound:.3e} (2 * lowp "
                                   f"error {self.low:.3e} + {atol:g}); worst at (key row, kv head, col, got, ref) = "
                                   f"{self.worst}")


def _round_bf16(x):
    import cupy

    return x.astype(_bf16()).astype(cupy.float32)


def _bf16_scores(raw, scale):
    """S as a plain bf16 implementation rounds it: the product, then the scaled score."""
    return _round_bf16(_round_bf16(raw) * scale)


def _chunked_reference(q, k, v, dout, causal, got_dk=None, got_dv=None, low_scores=_bf16_scores,
                       low_p=_round_bf16, out_given=None, fp8_bound=False):
    """Attention of one sequence: q, dout (sq, H, D); k, v (sk, Hkv, D) bf16 (or float32) views (sk may
    pass 2^22).

    Returns a dict of float32 CuPy arrays: out / out_low (sq, H, D), lse (H, sq) and "fp8_bound": with
    ``fp8_bound``, reference.fp8_score_error_bound (aligned keys' term included) over the visible (query,
    key) pairs, else 0; with ``dout`` also
    dq / dq_low (sq, H, D), and with ``got_dk`` / ``got_dv`` (the kernel's (sk, Hkv, D) gradients)
    the _Tally of each, already fed. The low-precision model rounds the scores with ``low_scores(raw,
    scale)`` and P with ``low_p`` (bf16 both by default; the FP8 kernel: exact scores, P in e4m3).

    ``out_given``: the output the backward was given (the forward's, in bf16). The gradients are then the
    exact ones for the backward's inputs: D = rowsum(dO o out_given), as every FlashAttention backward
    computes it. Over a million keys with a needle holding most of a row's weight, D from the bf16 output
    moves dq by up to ~4e-2 -- about what the plain bf16 model's own error is, so against a D from the
    exact output the rule failed by chance (a NumPy model of the kernels' rounding, seeds 2-6 at 1M keys:
    0.4-1.95x the bf16 model's error; with D from the given output 0.1-0.25x). The forward's output is
    checked on its own (_check_forward).
    """
    import cupy

    f32 = cupy.float32
    sq, h, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    g = h // hkv
    rows = g * sq
    scale = 1.0 / np.sqrt(d)

    def stack(x):  # (sq, H, D) -> (Hkv, g * sq, D); stacked row r = gi * sq + i is query i of head kv * g + gi
        return x.astype(f32).reshape(sq, hkv, g, d).transpose(1, 2, 0, 3).reshape(hkv, rows, d)

    def unstack(x):  # (Hkv, g * sq, D) -> (sq, H, D)
        return x.astype(f32).reshape(hkv, g, sq, d).transpose(2, 0, 1, 3).reshape(sq, h, d)

    qr = stack(q)
    last_visible = cupy.arange(rows) % sq + (sk - sq)  # causal (bottom-right): key j visible iff j <= this

    def chunks():
        for s in range(0, sk, CHUNK):
            e = min(s + CHUNK, sk)
            kc = k[s:e].astype(f32).transpose(1, 0, 2)  # (Hkv, C, D)
            vc = v[s:e].astype(f32).transpose(1, 0, 2)
            raw = cupy.matmul(qr, kc.transpose(0, 2, 1))  # (Hkv, rows, C), fp32 accumulation
            s32 = raw * f32(scale)
            slow = low_scores(raw, f32(scale))
            if causal:
                hidden = cupy.arange(s, e)[None, :] > last_visible[:, None]
                s32 = cupy.where(hidden[None], -cupy.inf, s32).astype(f32)
                slow = cupy.where(hidden[None], -cupy.inf, slow).astype(f32)
            yield s, kc, vc, s32, slow, raw

    def online(m, l, acc, s, vc):
        m_new = cupy.maximum(m, s.max(axis=-1))
        safe = cupy.where(cupy.isneginf(m_new), 0.0, m_new).astype(f32)
        alpha = cupy.exp(m - safe)
        p = cupy.exp(s - safe[..., None])
        l = l * alpha + p.sum(axis=-1, dtype=cupy.float64)
        if acc is not None:
            acc = acc * alpha[..., None] + cupy.matmul(p, vc)
        return m_new, l, acc

    # pass 1: exact online softmax (out, lse) and the low-precision softmax statistics
    m = cupy.full((hkv, rows), -cupy.inf, dtype=f32)
    m_low = m.copy()
    l = cupy.zeros((hkv, rows), dtype=cupy.float64)
    l_low = l.copy()
    acc = cupy.zeros((hkv, rows, d), dtype=cupy.float64)
    magnitude = 0.0
    for s, kc, vc, s32, slow, raw in chunks():
        m, l, acc = online(m, l, acc, s32, vc)
        m_low, l_low, _ = online(m_low, l_low, None, slow, None)
        if fp8_bound:
            units = ref.fp8_score_error_units(d, cupy.matmul(cupy.abs(qr), cupy.abs(kc).transpose(0, 2, 1)), raw)
            if causal:
                units = cupy.where(cupy.arange(s, s + kc.shape[1])[None, None, :] > last_visible[None, :, None], 0, units)
            magnitude = max(magnitude, float(units.max()) * scale * 2.0**-14)
    lse = (m + cupy.log(l)).astype(f32)  # rows that see no key: -inf
    lse_low = (m_low + cupy.log(l_low)).astype(f32)
    # exp(s - lse) with s = lse = -inf would be NaN: such rows (no visible key) get P = exp(-inf - 0) = 0
    lse_safe = cupy.where(cupy.isneginf(lse), 0.0, lse).astype(f32)
    lse_low_safe = cupy.where(cupy.isneginf(lse_low), 0.0, lse_low).astype(f32)
    out_rows = cupy.where(l[..., None] > 0, acc / cupy.maximum(l, 1e-300)[..., None], 0.0).astype(f32)

    # pass 2: the low-precision output (P rounded to bf16) and, for the backward, its rowsum(P * dP)
    dor = stack(dout) if dout is not None else None
    acc_low = cupy.zeros((hkv, rows, d), dtype=cupy.float64)
    delta_low = cupy.zeros((hkv, rows), dtype=cupy.float64)
    for _, _, vc, _, slow, _ in chunks():
        p_low = low_p(cupy.exp(slow - lse_low_safe[..., None]))
        acc_low += cupy.matmul(p_low, vc)
        if dor is not None:
            dp_low = _round_bf16(cupy.matmul(dor, vc.transpose(0, 2, 1)))
            delta_low += (p_low * dp_low).sum(axis=-1, dtype=cupy.float64)
    res = {"out": unstack(out_rows), "out_low": unstack(_round_bf16(acc_low)),
           "lse": lse.reshape(hkv * g, sq), "fp8_bound": magnitude}
    if dor is None:
        return res

    # pass 3: gradients. dk / dv are compared chunk by chunk, dq accumulated.
    o_for_delta = out_rows if out_given is None else stack(out_given)
    delta = (dor * o_for_delta).sum(axis=-1)  # rowsum(dO o O) = rowsum(P o dP)
    delta_low = delta_low.astype(f32)
    dq = cupy.zeros((hkv, rows, d), dtype=cupy.float64)
    dq_low = cupy.zeros((hkv, rows, d), dtype=cupy.float64)
    tallies = {"dk": _Tally("dk"), "dv": _Tally("dv")}
    for s, kc, vc, s32, slow, _ in chunks():
        p = cupy.exp(s32 - lse_safe[..., None])
        p_low = _round_bf16(cupy.exp(slow - lse_low_safe[..., None]))
        dp = cupy.matmul(dor, vc.transpose(0, 2, 1))
        ds = p * (dp - delta[..., None]) * f32(scale)
        dp_low = _round_bf16(dp)
        ds_low = _round_bf16(_round_bf16(p_low * (dp_low - delta_low[..., None])) * f32(scale))
        dq += cupy.matmul(ds, kc)
        dq_low += cupy.matmul(ds_low, kc)
        if got_dv is not None:
            e = s + kc.shape[1]
            dv_ref = cupy.matmul(p.transpose(0, 2, 1), dor)  # (Hkv, C, D): sums the group's query heads
            dv_low = _round_bf16(cupy.matmul(p_low.transpose(0, 2, 1), dor))
            tallies["dv"].add(got_dv[s:e].transpose(1, 0, 2), dv_ref, dv_low, s)
            del dv_ref, dv_low
            dk_ref = cupy.matmul(ds.transpose(0, 2, 1), qr)
            dk_low = _round_bf16(cupy.matmul(ds_low.transpose(0, 2, 1), qr))
            tallies["dk"].add(got_dk[s:e].transpose(1, 0, 2), dk_ref, dk_low, s)
            del dk_ref, dk_low
    res.update(dq=unstack(dq), dq_low=unstack(_round_bf16(dq_low)), tallies=tallies)
    return res


def _check_forward(name, out, lse, want):
    ref.check_close(f"{name} out", out, want["out"], want["out_low"])
    ref.check_close(f"{name} lse", lse, want["lse"], want["lse"], atol=LSE_ATOL)


# ----------------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("impl", ["fa3", "fa2", "fa1"])
def test_kv_past_2_31_elements(poison_allocations, big_kv, impl, causal):
    import cupy

    if impl not in cuflash.available_impls("backward"):
        pytest.skip(f"{impl} does not run on this GPU")
    k, v = big_kv
    rng_seed = _seed()
    rng, nprng = cupy.random.default_rng(rng_seed), np.random.default_rng(rng_seed)
    q = _randn(rng, (1, SEQLEN_Q, HEADS, D))
    dout = _randn(rng, (1, SEQLEN_Q, HEADS, D))
    special = [SEQLEN_K - 1, BOUNDARY_ROW, BOUNDARY_ROW - 1, SEQLEN_K - 2, BOUNDARY_ROW + 17, 0]
    _plant_needles(q[0], k[0], _needle_rows(nprng, SEQLEN_Q, 0, SEQLEN_K, special))

    out, lse = cuflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, impl=impl)
    dq, dk, dv = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, impl=impl)
    cupy.cuda.get_current_stream().synchronize()
    assert out.shape == q.shape and lse.shape == (1, HEADS, SEQLEN_Q) and dk.shape == k.shape

    want = _chunked_reference(q[0], k[0], v[0], dout[0], causal, got_dk=dk[0], got_dv=dv[0], out_given=out[0])
    _check_forward(impl, out[0], lse[0], want)
    ref.check_close(f"{impl} dq", dq[0], want["dq"], want["dq_low"])
    for tally in want["tallies"].values():
        tally.check()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_past_2_31_elements(poison_allocations, big_kv, paged, causal):
    """flash_attn_with_kvcache over the same K/V (seqlen_q = 3 queries after the whole cache): the same
    attention as flash_attn_func with bottom-right causal, so the same chunked reference."""
    import cupy

    k, v = big_kv
    rng_seed = _seed()
    rng, nprng = cupy.random.default_rng(rng_seed), np.random.default_rng(rng_seed)
    q = _randn(rng, (1, SEQLEN_Q, HEADS, D))
    special = [SEQLEN_K - 1, BOUNDARY_ROW, BOUNDARY_ROW - 1, BOUNDARY_ROW + 5, 0]
    _plant_needles(q[0], k[0], _needle_rows(nprng, SEQLEN_Q, 0, SEQLEN_K, special))
    if paged:  # page j (one key row) is physical page j: the caches as (SEQLEN_K, 1, Hkv, D) views
        kc, vc = k.reshape(SEQLEN_K, 1, KV_HEADS, D), v.reshape(SEQLEN_K, 1, KV_HEADS, D)
        table = cupy.arange(SEQLEN_K, dtype=cupy.int32).reshape(1, SEQLEN_K)
    else:
        kc, vc, table = k, v, None
    out, lse = cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=SEQLEN_K, page_table=table, causal=causal,
                                               return_softmax_lse=True)
    cupy.cuda.get_current_stream().synchronize()
    want = _chunked_reference(q[0], k[0], v[0], None, causal)
    _check_forward(f"kvcache {'paged' if paged else 'contiguous'}", out[0], lse[0], want)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("impl", ["fa3", "fa2"])  # (fa1 has no varlen)
def test_varlen_kv_past_2_31_elements(poison_allocations, big_kv, impl, causal):
    import cupy

    if impl not in cuflash.available_impls("backward"):
        pytest.skip(f"{impl} does not run on this GPU")
    k, v = big_kv
    kp, vp = k[0], v[0]  # packed (total_k, Hkv, D) views of the same rows
    cu_k = np.concatenate([[0], np.cumsum(VARLEN_K)]).astype(np.int32)
    cu_q = np.concatenate([[0], np.cumsum(VARLEN_Q)]).astype(np.int32)
    assert cu_k[-1] == SEQLEN_K and cu_k[-2] < BOUNDARY_ROW < cu_k[-1]
    rng_seed = _seed()
    rng, nprng = cupy.random.default_rng(rng_seed), np.random.default_rng(rng_seed)
    total_q = int(cu_q[-1]) + VARLEN_EXTRA_Q
    q = _randn(rng, (total_q, HEADS, D))
    dout = _randn(rng, (total_q, HEADS, D))
    for b in range(len(VARLEN_Q)):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if qe > qs and ke > ks:
            special = [ke - 1, ks, BOUNDARY_ROW, BOUNDARY_ROW - 1, SEQLEN_K - 1]
            _plant_needles(q[qs:qe], kp, _needle_rows(nprng, qe - qs, ks, ke, special))

    args = (cupy.asarray(cu_q), cupy.asarray(cu_k), max(VARLEN_Q), max(VARLEN_K))
    out, lse = cuflash.flash_attn_varlen_func(q, kp, vp, *args, causal=causal, return_lse=True, impl=impl)
    dq, dk, dv = cuflash.flash_attn_varlen_backward(dout, q, kp, vp, out, lse, *args, causal=causal, impl=impl)
    cupy.cuda.get_current_stream().synchronize()

    for b in range(len(VARLEN_Q)):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if qe == qs:
            continue
        if ke == ks:  # no keys: out 0, lse -inf, dq 0
            assert float(cupy.abs(out[qs:qe].astype(cupy.float32)).max()) == 0.0
            assert bool((lse[:, qs:qe] == -cupy.inf).all())
            assert float(cupy.abs(dq[qs:qe].astype(cupy.float32)).max()) == 0.0
            continue
        want = _chunked_reference(q[qs:qe], kp[ks:ke], vp[ks:ke], dout[qs:qe], causal, got_dk=dk[ks:ke],
                                  got_dv=dv[ks:ke], out_given=out[qs:qe])
        _check_forward(f"sequence {b}", out[qs:qe], lse[:, qs:qe], want)
        ref.check_close(f"sequence {b} dq", dq[qs:qe], want["dq"], want["dq_low"])
        for tally in want["tallies"].values():
            tally.name = f"sequence {b} {tally.name}"
            tally.check()
        del want
    tail = slice(int(cu_q[-1]), None)  # rows of no sequence
    assert float(cupy.abs(out[tail].astype(cupy.float32)).max()) == 0.0
    assert bool((lse[:, tail] == -cupy.inf).all())
    assert float(cupy.abs(dq[tail].astype(cupy.float32)).max()) == 0.0


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_kv_past_2_31_elements(poison_allocations, big_kv, causal):
    """The FP8 forward on the same K/V quantised to e4m3 (2^31 + 18,944 elements each: the V transpose and
    the kernel address rows past element 2^31): out and LSE against the chunked reference on the dequantised
    values in float32, with P rounded to e4m3 as the low-precision model and atol 1e-2, as in
    tests/test_fp8_attention_gpu.py. q and k share the Hadamard rotation, so their dot products are the
    original ones and the needles still stand out."""
    import cupy

    from cuflash import fp8

    if "fa3" not in cuflash.available_impls("forward"):
        pytest.skip("the FP8 forward is FA3's (Hopper)")
    free, _ = cupy.cuda.runtime.memGetInfo()
    if free < 40 << 30:  # e4m3 K/V and V^T 6.5 GB, float32 copies of K/V 17 GB, reference temporaries
        pytest.skip(f"needs 40 GiB of free GPU memory next to K/V; {free / 2**30:.1f} GiB free")
    k, v = big_kv
    seed = _seed()
    rng, nprng = cupy.random.default_rng(seed), np.random.default_rng(seed)
    q = _randn(rng, (1, SEQLEN_Q, HEADS, D))
    special = [SEQLEN_K - 1, BOUNDARY_ROW, BOUNDARY_ROW - 1, SEQLEN_K - 2, BOUNDARY_ROW + 17, 0]
    _plant_needles(q[0], k[0], _needle_rows(nprng, SEQLEN_Q, 0, SEQLEN_K, special))
    q8, qs = fp8.quantize(q, block=None, hadamard=True, seed=seed)
    k8, ks = fp8.quantize(k, block=128, hadamard=True, seed=seed)
    v8, vs = fp8.quantize(v, block=128, hadamard=False)
    out, lse = cuflash.flash_attn_func(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs, fp8_format="e4m3",
                                       descale_block=(128, 128), causal=causal, return_lse=True)
    cupy.cuda.get_current_stream().synchronize()
    assert out.shape == q.shape and str(out.dtype) == "bfloat16" and lse.shape == (1, HEADS, SEQLEN_Q)

    def dequantised(data, descale):  # (sk, Hkv, D) float32, chunk by chunk (CHUNK is whole 128-row blocks)
        x = cupy.empty(data.shape[1:], dtype=cupy.float32)
        for s in range(0, data.shape[1], CHUNK):
            e = min(s + CHUNK, data.shape[1])
            x[s:e] = ref._dequantize_e4m3(data[:, s:e], descale[:, :, s // 128:-(-e // 128)], 128, cupy.float32)[0]
        return x

    qf = ref._dequantize_e4m3(q8, qs, SEQLEN_Q, cupy.float32)[0]
    kf = dequantised(k8, ks)
    vf = dequantised(v8, vs)
    del k8, v8
    want = _chunked_reference(qf, kf, vf, None, causal, low_scores=lambda raw, scale: raw * scale,
                              low_p=ref.round_e4m3, fp8_bound=True)
    del kf, vf
    # as reference.check_fp8_attention: 1e-2, or twice the tensor cores' score error bound where larger;
    # a needle's score is ~24 here and its row's LSE moves with it (CUFLASH_LARGE_SEED=409687613: 1.75e-2)
    ref.check_close("fp8 out", out[0], want["out"], want["out_low"], atol=1e-2)
    ref.check_close("fp8 lse", lse[0], want["lse"], want["lse"], atol=LSE_ATOL + max(1e-2, 2 * want["fp8_bound"]))
