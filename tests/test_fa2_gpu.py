"""FA2 forward against the fp32 reference by FlashAttention's tolerance rule (GPU tier), outputs
poisoned; every feature of the forward: head dims, causal, window, softcap, ALiBi, GQA/MQA, odd and
unequal lengths, fp16, strided inputs."""
import numpy as np
import pytest

import cuflash
from cuflash import reference as ref
from test_fa1_gpu import _inputs

pytestmark = pytest.mark.gpu

HEADDIMS = (32, 64, 96, 128, 192, 256)
SEQLENS = [(113, 239), (239, 113), (1, 1023), (1023, 1023), (7, 1), (4224, 129)]
HEADS = [(4, 4), (6, 2), (4, 1)]


def _check(q, k, v, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    out, lse = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                       alibi_slopes=alibi_slopes, return_lse=True, impl="fa2")
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi_slopes)
    o_ref, lse_ref = ref.attention_ref(q, k, v, **kw)
    o_low, _ = ref.attention_ref_lowp(q, k, v, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    ref.check_close("out", out, o_ref, o_low)
    ref.check_close("lse", lse, lse_ref, lse_ref, atol=2e-3)
    return out, lse


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


def test_auto_prefers_fa2_forward_and_fa1_backward():
    q, k, v = _inputs(np.random.default_rng(), 1, 64, 64, 2, 2, 64, "bfloat16")
    a = cuflash.flash_attn_func(q, k, v, impl="auto")
    b = cuflash.flash_attn_func(q, k, v, impl="fa2")
    assert bool((a.view("uint16") == b.view("uint16")).all())


def test_forward_is_deterministic():
    q, k, v = _inputs(np.random.default_rng(), 2, 333, 333, 4, 4, 128, "bfloat16")
    a = cuflash.flash_attn_func(q, k, v, causal=True, impl="fa2")
    b = cuflash.flash_attn_func(q, k, v, causal=True, impl="fa2")
    assert bool((a.view("uint16") == b.view("uint16")).all())
