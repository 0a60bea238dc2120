"""FA1 kernels against the fp32 reference by FlashAttention's tolerance rule (GPU tier).

Outputs come from a poisoned allocator (NaN bytes), so an element the kernel forgets to write fails.
"""
import numpy as np
import pytest

import cuflash
from cuflash import reference as ref
from gpu_checks import check_backward, check_forward, inputs

pytestmark = pytest.mark.gpu

HEADDIMS = (32, 64, 96, 128, 256)
# (seqlen_q, seqlen_k): odd sizes on purpose, Sq != Sk both ways, single rows.
SEQLENS = [(113, 239), (239, 113), (1, 1023), (1023, 1023), (7, 1)]
HEADS = [(4, 4), (6, 2), (4, 1)]  # (heads, kv_heads): MHA, GQA, MQA


_inputs = inputs


def _check_forward(q, k, v, causal, window=(-1, -1)):
    return check_forward("fa1", q, k, v, causal=causal, window_size=window, lse_atol=1e-3)


@pytest.mark.parametrize("d", HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", SEQLENS)
@pytest.mark.parametrize("heads", HEADS)
def test_forward(poison_allocations, d, causal, seqlens, heads):
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, 2, *seqlens, *heads, d, "bfloat16")
    _check_forward(q, k, v, causal)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [(32, 0), (17, 40), (-1, 5), (0, 0)])
def test_forward_window(poison_allocations, d, window):
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, 2, 239, 300, 4, 2, d, "bfloat16")
    _check_forward(q, k, v, causal=False, window=window)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_forward_fp16(poison_allocations, d):
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, 2, 200, 333, 4, 2, d, "float16")
    _check_forward(q, k, v, causal=True)


def test_forward_empty_rows_are_zero_with_neg_inf_lse(poison_allocations):
    """Causal with Sq > Sk: the top Sq - Sk rows see no key: O = 0, LSE = -inf."""
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, 1, 100, 40, 2, 2, 64, "bfloat16")
    out, lse = _check_forward(q, k, v, causal=True)
    assert float(abs(out[:, :60].astype("float32")).max()) == 0.0
    assert bool((lse[:, :, :60] == -np.inf).all())


def test_forward_strided_inputs(poison_allocations):
    """Non-contiguous q/k/v (a packed qkv tensor sliced apart) are read in place."""
    import cupy

    rng = np.random.default_rng()
    qkv = cupy.asarray(rng.standard_normal((2, 177, 3, 4, 64), dtype=np.float32)).astype("bfloat16")
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    _check_forward(q, k, v, causal=True)


def _check_backward(q, k, v, causal, window=(-1, -1)):
    check_backward("fa1", q, k, v, causal=causal, window_size=window)


@pytest.mark.parametrize("d", HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(113, 239), (239, 113), (1, 200), (300, 300)])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (3, 1)])
def test_backward(poison_allocations, d, causal, seqlens, heads):
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, 2, *seqlens, *heads, d, "bfloat16")
    _check_backward(q, k, v, causal)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [(32, 0), (17, 40)])
def test_backward_window(poison_allocations, d, window):
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, 1, 239, 300, 4, 2, d, "bfloat16")
    _check_backward(q, k, v, causal=False, window=window)


@pytest.mark.parametrize("d", [64, 256])
def test_backward_fp16(poison_allocations, d):
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, 2, 150, 97, 4, 2, d, "float16")
    _check_backward(q, k, v, causal=True)


def test_forward_is_deterministic():
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, 2, 333, 333, 4, 4, 128, "bfloat16")
    a = cuflash.flash_attn_func(q, k, v, causal=True, impl="fa1")
    b = cuflash.flash_attn_func(q, k, v, causal=True, impl="fa1")
    assert bool((a.view("uint16") == b.view("uint16")).all())


def test_forward_memory_is_lse_only_at_16k():
    """O(N): beyond inputs and output, the forward allocates the fp32 LSE and nothing else; the naive
    reference needs the N x N score matrix."""
    import cupy

    rng = np.random.default_rng()
    n, h, d = 16384, 2, 128
    q, k, v = _inputs(rng, 1, n, n, h, h, d, "bfloat16")
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    out, lse = cuflash.flash_attn_func(q, k, v, causal=True, return_lse=True, impl="fa1")
    cupy.cuda.Device().synchronize()
    extra = pool.total_bytes() - before
    assert extra <= out.nbytes + lse.nbytes + 2 * 512, (extra, out.nbytes, lse.nbytes)
    del out, lse

    pool.free_all_blocks()
    before = pool.total_bytes()
    ref.attention_naive(q, k, v, causal=True)
    cupy.cuda.Device().synchronize()
    naive_extra = pool.total_bytes() - before
    assert naive_extra >= h * n * n * 2, naive_extra  # at least one N x N matrix per head in bf16


def test_torch_inputs_roundtrip():
    torch = pytest.importorskip("torch")
    q = torch.randn(2, 130, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 170, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 170, 2, 64, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # runs on torch's current stream, no extra sync needed
        out, lse = cuflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
        dout = torch.randn_like(q)
        dq, dk, dv = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    stream.synchronize()
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == q.shape
    qt, kt, vt = (x.detach().float().requires_grad_() for x in (q, k, v))
    o_ref = torch.nn.functional.scaled_dot_product_attention(
        qt.transpose(1, 2), kt.transpose(1, 2), vt.transpose(1, 2), is_causal=False,
        attn_mask=torch.ones(130, 170, dtype=torch.bool, device="cuda").tril(170 - 130), enable_gqa=True,
    ).transpose(1, 2)
    assert (out.float() - o_ref).abs().max().item() < 2e-2
    o_ref.backward(dout.float())
    for g, r in ((dq, qt.grad), (dk, kt.grad), (dv, vt.grad)):
        assert g.shape == r.shape and (g.float() - r).abs().max().item() < 5e-2


def test_jax_inputs_roundtrip():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    if not any(dev.platform == "gpu" for dev in jax.devices()):
        pytest.skip("JAX sees no GPU")
    key = jax.random.PRNGKey(0)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (1, 100, 4, 64), dtype=jnp.bfloat16)
    k = jax.random.normal(kk, (1, 90, 4, 64), dtype=jnp.bfloat16)
    v = jax.random.normal(kv, (1, 90, 4, 64), dtype=jnp.bfloat16)
    out = cuflash.flash_attn_func(q, k, v)
    assert isinstance(out, jax.Array) and out.shape == q.shape and out.dtype == jnp.bfloat16
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) / 8.0
    o_ref = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32))
    assert float(jnp.abs(out.astype(jnp.float32) - o_ref).max()) < 2e-2
