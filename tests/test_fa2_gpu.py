"""FA2 forward against the fp32 reference by FlashAttention's tolerance rule (GPU tier), outputs
poisoned; every feature of the forward: head dims, causal, window, softcap, ALiBi, GQA/MQA, odd and
unequal lengths, fp16, strided inputs."""
import importlib

import numpy as np
import pytest

import cuflash
from cuflash import reference as ref
from gpu_checks import check_backward, check_forward, check_varlen_backward, varlen_batch
from gpu_checks import inputs as _inputs

pytestmark = pytest.mark.gpu

HEADDIMS = (32, 64, 96, 128, 192, 256)
SEQLENS = [(113, 239), (239, 113), (1, 1023), (1023, 1023), (7, 1), (4224, 129)]
HEADS = [(4, 4), (6, 2), (4, 1)]


def _check(q, k, v, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    return check_forward("fa2", q, k, v, causal=causal, window_size=window, softcap=softcap,
                         alibi_slopes=alibi_slopes)


@pytest.mark.parametrize("d", HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", SEQLENS)
@pytest.mark.parametrize("heads", HEADS)
def test_forward(poison_allocations, d, causal, seqlens, heads):
    b = 1 if seqlens[0] > 2000 else 2
    q, k, v = _inputs(np.random.default_rng(), b, *seqlens, *heads, d, "bfloat16")
    _check(q, k, v, causal)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window", [(32, 0), (17, 40), (-1, 5), (0, 0), (100, -1)])
def test_window(poison_allocations, d, window):
    q, k, v = _inputs(np.random.default_rng(), 2, 239, 300, 4, 2, d, "bfloat16")
    _check(q, k, v, window=window)


@pytest.mark.parametrize("d", [64, 128, 192])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap(poison_allocations, d, causal):
    q, k, v = _inputs(np.random.default_rng(), 2, 177, 250, 4, 2, d, "bfloat16")
    q = (q.astype("float32") * 4).astype("bfloat16")  # large logits, so the cap matters
    _check(q, k, v, causal=causal, softcap=5.0)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 8.0])
def test_alibi(poison_allocations, d, causal, softcap):
    import cupy

    q, k, v = _inputs(np.random.default_rng(), 2, 150, 233, 8, 2, d, "bfloat16")
    slopes = cupy.asarray(2.0 ** (-8.0 * np.arange(1, 9) / 8), dtype=cupy.float32)
    _check(q, k, v, causal=causal, softcap=softcap, alibi_slopes=slopes)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp16(poison_allocations, d):
    q, k, v = _inputs(np.random.default_rng(), 2, 200, 333, 4, 2, d, "float16")
    _check(q, k, v, causal=True)


def test_strided_inputs(poison_allocations):
    import cupy

    qkv = cupy.asarray(np.random.default_rng().standard_normal((2, 177, 3, 4, 128), dtype=np.float32))
    qkv = qkv.astype("bfloat16")
    _check(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)


def test_empty_rows(poison_allocations):
    q, k, v = _inputs(np.random.default_rng(), 1, 300, 40, 2, 2, 128, "bfloat16")
    out, lse = _check(q, k, v, causal=True)
    assert float(abs(out[:, :260].astype("float32")).max()) == 0.0
    assert bool((lse[:, :, :260] == -np.inf).all())


def test_auto_follows_the_preference_order():
    """impl="auto" runs the first family of heuristics.IMPL_PREFERENCE that this GPU runs: the same bits
    as asking for it by name (forward: all of O; backward: dK and dV, since dQ sums fp32 atomics)."""
    import cupy

    from cuflash.heuristics import IMPL_PREFERENCE

    rng = np.random.default_rng()
    q, k, v = _inputs(rng, 1, 200, 200, 2, 2, 64, "bfloat16")
    fwd = next(n for n in IMPL_PREFERENCE["forward"] if n in cuflash.available_impls("forward"))
    bwd = next(n for n in IMPL_PREFERENCE["backward"] if n in cuflash.available_impls("backward"))
    out, lse = cuflash.flash_attn_func(q, k, v, return_lse=True, impl="auto")
    named = cuflash.flash_attn_func(q, k, v, impl=fwd)
    assert bool((out.view("uint16") == named.view("uint16")).all()), f"auto forward is not {fwd}"
    dout = cupy.asarray(rng.standard_normal(q.shape, dtype=np.float32)).astype("bfloat16")
    _, dk_a, dv_a = cuflash.flash_attn_backward(dout, q, k, v, out, lse, impl="auto")
    _, dk_b, dv_b = cuflash.flash_attn_backward(dout, q, k, v, out, lse, impl=bwd)
    assert bool((dk_a.view("uint16") == dk_b.view("uint16")).all()), f"auto backward is not {bwd}"
    assert bool((dv_a.view("uint16") == dv_b.view("uint16")).all()), f"auto backward is not {bwd}"


def test_forward_is_deterministic():
    q, k, v = _inputs(np.random.default_rng(), 2, 333, 333, 4, 4, 128, "bfloat16")
    a = cuflash.flash_attn_func(q, k, v, causal=True, impl="fa2")
    b = cuflash.flash_attn_func(q, k, v, causal=True, impl="fa2")
    assert bool((a.view("uint16") == b.view("uint16")).all())


# --- backward ------------------------------------------------------------------------------------------

def _check_backward(q, k, v, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False):
    return check_backward("fa2", q, k, v, causal=causal, window_size=window, softcap=softcap,
                          alibi_slopes=alibi_slopes, deterministic=deterministic)


@pytest.mark.parametrize("d", HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(113, 239), (239, 113), (1, 200), (300, 300)])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (3, 1)])
def test_backward(poison_allocations, d, causal, seqlens, heads):
    q, k, v = _inputs(np.random.default_rng(), 2, *seqlens, *heads, d, "bfloat16")
    _check_backward(q, k, v, causal)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window", [(32, 0), (17, 40), (-1, 5)])
def test_backward_window(poison_allocations, d, window):
    q, k, v = _inputs(np.random.default_rng(), 1, 239, 300, 4, 2, d, "bfloat16")
    _check_backward(q, k, v, window=window)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_softcap_alibi(poison_allocations, d, causal):
    import cupy

    q, k, v = _inputs(np.random.default_rng(), 2, 150, 233, 8, 2, d, "bfloat16")
    q = (q.astype("float32") * 3).astype("bfloat16")
    slopes = cupy.asarray(2.0 ** (-8.0 * np.arange(1, 9) / 8), dtype=cupy.float32)
    _check_backward(q, k, v, causal=causal, softcap=6.0)
    _check_backward(q, k, v, causal=causal, alibi_slopes=slopes)
    _check_backward(q, k, v, causal=causal, softcap=6.0, alibi_slopes=slopes)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_fp16(poison_allocations, d):
    q, k, v = _inputs(np.random.default_rng(), 2, 150, 97, 4, 2, d, "float16")
    _check_backward(q, k, v, causal=True)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_deterministic_is_bit_identical(d, causal):
    """Many K blocks add into each dQ row; the deterministic mode orders them, so two runs agree bit
    for bit (and match the reference)."""
    q, k, v = _inputs(np.random.default_rng(), 2, 1100, 1300, 4, 2, d, "bfloat16")
    dout, out, lse, first = _check_backward(q, k, v, causal=causal, deterministic=True)
    for _ in range(3):
        again = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, impl="fa2", deterministic=True)
        for a, b in zip(first, again):
            assert bool((a.view("uint16") == b.view("uint16")).all())


def test_auto_backward_deterministic_picks_the_first_family_with_the_mode():
    """impl="auto" with deterministic=True runs the first family of the backward preference order that
    has the mode on this GPU (FA3 on Hopper since it has one, else FA2): the same bits as asking for it."""
    from cuflash import heuristics

    q, k, v = _inputs(np.random.default_rng(), 1, 200, 200, 2, 2, 64, "bfloat16")
    out, lse = cuflash.flash_attn_func(q, k, v, return_lse=True)
    dout = q.copy()
    available = cuflash.available_impls("backward")
    expected = next(name for name in heuristics.IMPL_PREFERENCE["backward"] if name in available
                    and "deterministic" in importlib.import_module(f"cuflash.{name}").BWD_FEATURES)
    a = cuflash.flash_attn_backward(dout, q, k, v, out, lse, deterministic=True)
    b = cuflash.flash_attn_backward(dout, q, k, v, out, lse, deterministic=True, impl=expected)
    for x, y in zip(a, b):
        assert bool((x.view("uint16") == y.view("uint16")).all())


# --- variable-length batches ---------------------------------------------------------------------------

VARLEN_CASES = [
    ([113, 0, 1, 239, 64], [239, 5, 1, 113, 64]),  # empty and length-1 sequences, Sq != Sk both ways
    ([300, 7, 1024], [300, 1, 1024]),
    ([1, 1, 1], [1000, 0, 77]),  # empty K: rows see nothing (out 0, lse -inf)
]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", VARLEN_CASES)
def test_varlen_forward_backward(d, causal, lens):
    check_varlen_backward("fa2", np.random.default_rng(), *lens, 6, 2, d, causal=causal)


def test_varlen_bad_offsets_are_refused():
    import cupy

    q, k, v, cu_q, cu_k, _, _ = varlen_batch(np.random.default_rng(), [5, 6], [5, 6], 2, 2, 64)
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        cuflash.flash_attn_varlen_func(q, k, v, cupy.asarray([0, 6, 5], dtype=cupy.int32), cu_k, 6, 6)
    with pytest.raises(ValueError, match="max_seqlen_k = 3"):
        cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 3)
    with pytest.raises(TypeError, match="cu_seqlens_k must be int32"):
        cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k.astype(cupy.int64), 6, 6)
    with pytest.raises(ValueError, match="exceeds"):
        cuflash.flash_attn_varlen_func(q, k, v, cupy.asarray([0, 5, 600], dtype=cupy.int32), cu_k, 600, 6)


# --- dropout ------------------------------------------------------------------------------------------

def test_dropout_mask_is_the_reference_mask():
    """With q = 0 every visible key has P = 1/Sk, and with V = identity the output row i is
    keep[i, :] / ((1 - p) Sk): the kernel's mask read back exactly, against reference.dropout_mask."""
    import cupy

    sk, h, p_drop, seed = 128, 2, 0.25, 987654321
    q = cupy.zeros((1, 77, h, sk), dtype="bfloat16")
    k = cupy.asarray(np.random.default_rng().standard_normal((1, sk, h, sk), dtype=np.float32)).astype("bfloat16")
    v = cupy.asarray(np.broadcast_to(np.eye(sk, dtype=np.float32)[None, :, None, :], (1, sk, h, sk)).copy())
    v = v.astype("bfloat16")
    out = cuflash.flash_attn_func(q, k, v, dropout_p=p_drop, dropout_seed=seed, dropout_offset=3, impl="fa2")
    kept = (out.astype("float32").get() > 0).transpose(0, 2, 1, 3)  # (1, h, 77, sk)
    want = ref.dropout_mask(1, h, 77, sk, p_drop, seed, 3)
    assert (kept == want).all(), f"{int((kept != want).sum())} mismatches"
    assert abs(kept.mean() - (1 - p_drop)) < 0.02


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_forward_backward(poison_allocations, d, causal):
    import cupy

    rng = np.random.default_rng()
    b, sq, sk, h, hkv = 2, 150, 233, 4, 2
    q, k, v = _inputs(rng, b, sq, sk, h, hkv, d, "bfloat16")
    p_drop, seed, offset = 0.17, int(rng.integers(2 ** 63)), 5
    keep = ref.dropout_mask(b, h, sq, sk, p_drop, seed, offset)
    kw = dict(causal=causal, dropout_p=p_drop, dropout_seed=seed, dropout_offset=offset)
    out, lse = cuflash.flash_attn_func(q, k, v, return_lse=True, impl="fa2", **kw)
    rkw = dict(causal=causal, dropout_p=p_drop, dropout_keep=cupy.asarray(keep))
    o_ref, lse_ref = ref.attention_ref(q, k, v, **rkw)
    o_low, _ = ref.attention_ref_lowp(q, k, v, **rkw)
    ref.check_close("out", out, o_ref, o_low)
    ref.check_close("lse", lse, lse_ref, lse_ref, atol=2e-3)  # the LSE is the undropped one
    dout = cupy.asarray(rng.standard_normal(q.shape, dtype=np.float32)).astype(q.dtype)
    grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, impl="fa2", **kw)
    g_ref = ref.attention_ref_backward(dout, q, k, v, **rkw)
    g_low = ref.attention_ref_backward_lowp(dout, q, k, v, **rkw)
    for name, g, gr, gl in zip(("dq", "dk", "dv"), grads, g_ref, g_low):
        ref.check_close(name, g, gr, gl)


def test_dropout_reproducible_by_seed():
    q, k, v = _inputs(np.random.default_rng(), 1, 200, 200, 2, 2, 64, "bfloat16")
    a = cuflash.flash_attn_func(q, k, v, dropout_p=0.3, dropout_seed=42, impl="fa2")
    b = cuflash.flash_attn_func(q, k, v, dropout_p=0.3, dropout_seed=42, impl="fa2")
    c = cuflash.flash_attn_func(q, k, v, dropout_p=0.3, dropout_seed=43, impl="fa2")
    assert bool((a.view("uint16") == b.view("uint16")).all())
    assert not bool((a.view("uint16") == c.view("uint16")).all())


SMALL_SMEM = 101376  # a block's shared memory on sm_86 / sm_89


@pytest.mark.parametrize("d", sorted(cuflash.heuristics.FA2_BWD_TILES_SMALL_SMEM))
@pytest.mark.parametrize("causal", [False, True])
def test_backward_tiles_for_99_kb_gpus(poison_allocations, monkeypatch, d, causal):
    """The backward tiles of GPUs with 99 KB of shared memory per block (FA2_BWD_TILES_SMALL_SMEM: one
    Q / dO stage at d = 128, 32 and 16 keys per block at d = 192 / 256), run here by telling fa2 the
    device has that much: odd lengths both ways, GQA, softcap and ALiBi, the deterministic mode."""
    import cupy

    from cuflash import fa2

    monkeypatch.setattr(fa2, "max_smem_per_block", lambda device=0: SMALL_SMEM)
    assert fa2.bwd_variant(d, "bfloat16", max_smem=SMALL_SMEM).smem_bytes <= SMALL_SMEM
    rng = np.random.default_rng()
    for seqlens in ((113, 239), (239, 113)):
        q, k, v = _inputs(rng, 2, *seqlens, 6, 2, d, "bfloat16")
        _check_backward(q, k, v, causal)
    slopes = cupy.asarray(2.0 ** (-8.0 * np.arange(1, 7) / 6), dtype=cupy.float32)
    _check_backward(q, k, v, causal=causal, softcap=6.0, alibi_slopes=slopes)
    _check_backward(q, k, v, causal=causal, deterministic=True)
