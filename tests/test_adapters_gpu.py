"""cuflash.torch and cuflash.jax on the GPU: forward and gradients against fp32 references, the
torch.library custom ops (opcheck, torch.compile), the switch-off path, non-default streams, and JAX
eagerly and under jit.

Accuracy uses FlashAttention's rule (cuflash.reference.check_close): the error against an fp32
reference may be at most twice the error of the same attention done naively in bf16, plus atol.
"""
import itertools
import math
import os

# JAX grabs 75% of GPU memory at start by default; cuflash's temporaries come from CuPy's pool.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import cuflash  # noqa: E402
from cuflash import reference as ref  # noqa: E402

pytestmark = pytest.mark.gpu

H, HKV = 8, 2  # GQA 4:1 throughout


def _host(x):
    """float64 numpy copy of a torch tensor, CuPy array, JAX array or numpy array."""
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return x.detach().double().cpu().numpy()
    if mod == "cupy":
        return x.astype("float32").get().astype(np.float64)
    return np.asarray(x).astype(np.float32).astype(np.float64)


def _check(name, got, want, low, atol=1e-3):
    ref.check_close(name, _host(got), _host(want), _host(low), atol=atol)


def _cupy(x):
    """A CuPy view of a torch / JAX GPU array (for cuflash.reference's low-precision references)."""
    import cupy

    if type(x).__module__.split(".")[0] == "torch":
        x = x.detach()
    return cupy.from_dlpack(x)


def _need_impl():
    if not cuflash.available_impls():
        pytest.skip("no cuflash implementation runs on this GPU")


# ------------------------------------------------------------------------------------------------
# torch
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA device")
    _need_impl()
    return torch


@pytest.fixture
def ct(torch):
    import cuflash.torch as ct

    previous = ct.use_custom_op(True)
    yield ct
    ct.use_custom_op(previous)


def _torch_inputs(torch, b, sq, sk, d, dtype=None, seed=0, requires_grad=True):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = dtype or torch.bfloat16

    def rand(*shape):
        x = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
        return x.requires_grad_(requires_grad)

    return rand(b, sq, H, d), rand(b, sk, HKV, d), rand(b, sk, HKV, d)


def _sdpa_ref(torch, q, k, v, causal, softmax_scale=None):
    """torch SDPA (math backend) in fp64 with an explicit boolean mask (bottom-right causal); GQA by
    repeating the KV heads. Differentiable (the gradient reference); returns (B, Sq, H, D) fp64."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sq, sk, h, hk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq) if causal else None
    qt = q.double().transpose(1, 2)
    kt = k.double().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    vt = v.double().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    with sdpa_kernel(SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=softmax_scale)
    return o.transpose(1, 2)


def _lse_fp32(torch, q, k, causal):
    sq, sk, h, hk, d = q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]
    kt = k.detach().float().repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.detach().float(), kt) / math.sqrt(d)
    if causal:
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq), float("-inf"))
    return torch.logsumexp(s, dim=-1)


def _check_torch_against_reference(torch, ct, q, k, v, causal, dout=None):
    out, lse = ct.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert out.requires_grad and not lse.requires_grad
    if dout is None:
        dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    o_ref = _sdpa_ref(torch, q64, k64, v64, causal)
    g_ref = torch.autograd.grad(o_ref, (q64, k64, v64), dout.double())
    o_low, _ = ref.attention_ref_lowp(_cupy(q), _cupy(k), _cupy(v), causal=causal)
    g_low = ref.attention_ref_backward_lowp(_cupy(dout), _cupy(q), _cupy(k), _cupy(v), causal=causal)

    _check("out", out, o_ref, o_low)
    lse_ref = _lse_fp32(torch, q, k, causal)
    _check("lse", lse, lse_ref, lse_ref, atol=2e-3)
    for name, g, gr, gl, like in zip(("dq", "dk", "dv"), (dq, dk, dv), g_ref, g_low, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype
        _check(name, g, gr, gl)


@pytest.mark.parametrize("custom_op", [True, False], ids=["custom_op", "autograd_function"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("seqlens", [(128, 128), (113, 239)])
def test_torch_forward_and_grads_vs_sdpa(torch, ct, custom_op, causal, d, seqlens):
    ct.use_custom_op(custom_op)
    q, k, v = _torch_inputs(torch, 2, *seqlens, d)
    _check_torch_against_reference(torch, ct, q, k, v, causal)


def test_torch_fp16_and_broadcast_dout(torch, ct):
    """fp16 inputs, and ``out.sum().backward()`` whose dout is a stride-0 broadcast."""
    q, k, v = _torch_inputs(torch, 1, 96, 160, 64, dtype=torch.float16)
    out = ct.flash_attn_func(q, k, v, causal=True)
    out.float().sum().backward()
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    _sdpa_ref(torch, q64, k64, v64, True).sum().backward()
    ones = torch.ones_like(out)
    g_low = ref.attention_ref_backward_lowp(_cupy(ones), _cupy(q), _cupy(k), _cupy(v), causal=True)
    for name, x, x64, gl in zip(("dq", "dk", "dv"), (q, k, v), (q64, k64, v64), g_low):
        _check(name, x.grad, x64.grad, gl)


def _backward_takes(name):
    import inspect

    return name in inspect.signature(cuflash.flash_attn_backward).parameters


@pytest.mark.parametrize("custom_op", [True, False], ids=["custom_op", "autograd_function"])
def test_torch_deterministic_backward_is_bit_reproducible(torch, ct, custom_op):
    if not _backward_takes("deterministic"):
        pytest.skip("this cuflash's backward has no deterministic option")
    ct.use_custom_op(custom_op)
    q, k, v = _torch_inputs(torch, 2, 300, 300, 64)
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    runs = []
    for _ in range(3):
        out = ct.flash_attn_func(q, k, v, causal=True, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


def test_torch_softcap_forward_and_grads(torch, ct):
    """softcap goes through to cuflash in both directions (reference: cuflash.reference in fp32)."""
    if not _backward_takes("softcap"):
        pytest.skip("this cuflash's backward has no softcap")
    q, k, v = _torch_inputs(torch, 2, 113, 239, 64)
    out = ct.flash_attn_func(q, k, v, causal=True, softcap=5.0)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    cq, ck, cv, cdo = (_cupy(x) for x in (q, k, v, dout))
    o_ref, _ = ref.attention_ref(cq, ck, cv, causal=True, softcap=5.0)
    o_low, _ = ref.attention_ref_lowp(cq, ck, cv, causal=True, softcap=5.0)
    _check("out", out, o_ref, o_low)
    g_ref = ref.attention_ref_backward(cdo, cq, ck, cv, causal=True, softcap=5.0)
    g_low = ref.attention_ref_backward_lowp(cdo, cq, ck, cv, causal=True, softcap=5.0)
    for name, g, gr, gl in zip(("dq", "dk", "dv"), grads, g_ref, g_low):
        _check(name, g, gr, gl)


def test_torch_switch_selects_the_path(torch, ct):
    q, k, v = _torch_inputs(torch, 1, 64, 64, 64)
    ct.use_custom_op(True)
    a = ct.flash_attn_func(q, k, v, causal=True)
    assert "cuflash_flash_attn_fwd" in type(a.grad_fn).__name__
    ct.use_custom_op(False)
    b = ct.flash_attn_func(q, k, v, causal=True)
    assert "FlashAttnFunction" in type(b.grad_fn).__name__
    assert torch.equal(a, b)  # same kernels, deterministic forward


def test_torch_opcheck(torch, ct):
    q, k, v = _torch_inputs(torch, 1, 64, 96, 64)
    fwd, bwd = torch.ops.cuflash.flash_attn_fwd.default, torch.ops.cuflash.flash_attn_bwd.default
    tol = dict(atol=2e-2, rtol=2e-2)  # without deterministic=True, dQ's fp32 atomics add in any order
    torch.library.opcheck(fwd, (q, k, v, None, True, -1, -1, 0.0, None, "auto", False), **tol)
    torch.library.opcheck(fwd, (q, k, v, 0.2, False, 16, 8, 0.0, None, "auto", False), **tol)
    with torch.no_grad():
        out, lse = fwd(q, k, v, None, True, -1, -1, 0.0, None, "auto", False)
    dout = torch.randn_like(out)
    qd, kd, vd = (x.detach() for x in (q, k, v))
    torch.library.opcheck(bwd, (dout, qd, kd, vd, out, lse, None, True, -1, -1, 0.0, None, "auto", False), **tol)


@pytest.mark.parametrize("custom_op", [True, False], ids=["custom_op", "plain"])
@pytest.mark.parametrize("paged", [False, True])
def test_torch_kvcache_matches_the_plain_api(torch, ct, custom_op, paged):
    """cuflash.torch.flash_attn_with_kvcache: the same out/lse and the same in-place cache append as
    cuflash.flash_attn_with_kvcache on copies of the inputs."""
    ct.use_custom_op(custom_op)
    gen = torch.Generator(device="cuda").manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16)

    b, h, hkv, d, page = 3, 8, 2, 128, 16
    q, k_new, v_new = rand(b, 1, h, d), rand(b, 1, hkv, d), rand(b, 1, hkv, d)
    seqlens = torch.tensor([0, 17, 40], dtype=torch.int32, device="cuda")
    if paged:
        cache_k, cache_v = rand(12, page, hkv, d), rand(12, page, hkv, d)
        table = torch.randperm(12, device="cuda").to(torch.int32).reshape(b, 4)
    else:
        cache_k, cache_v, table = rand(b, 64, hkv, d), rand(b, 64, hkv, d), None
    ck2, cv2 = cache_k.clone(), cache_v.clone()
    out, lse = ct.flash_attn_with_kvcache(q, cache_k, cache_v, k_new, v_new, cache_seqlens=seqlens, page_table=table,
                                          causal=True, return_softmax_lse=True)
    want_out, want_lse = cuflash.flash_attn_with_kvcache(q, ck2, cv2, k_new, v_new, cache_seqlens=seqlens,
                                                         page_table=table, causal=True, return_softmax_lse=True)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert torch.equal(cache_k, ck2) and torch.equal(cache_v, cv2)  # both appended the same token


def test_torch_kvcache_opcheck(torch, ct):
    gen = torch.Generator(device="cuda").manual_seed(2)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16)

    q, cache_k, cache_v = rand(2, 1, 4, 64), rand(2, 32, 2, 64), rand(2, 32, 2, 64)
    k_new, v_new = rand(2, 1, 2, 64), rand(2, 1, 2, 64)
    seqlens = torch.tensor([5, 9], dtype=torch.int32, device="cuda")
    op = torch.ops.cuflash.flash_attn_with_kvcache.default
    torch.library.opcheck(op, (q, cache_k, cache_v, k_new, v_new, seqlens, 0, None, None, None, None, False, None,
                               True, -1, -1, 0.0, 0, True), atol=2e-2, rtol=2e-2)


def test_torch_compile_fullgraph(torch, ct):
    """A small attention block compiled with fullgraph=True (no graph break), forward and backward,
    against the same block run eagerly."""
    d_model, d = H * 64, 64

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(d_model, H * d, bias=False)
            self.kv = torch.nn.Linear(d_model, 2 * HKV * d, bias=False)
            self.o = torch.nn.Linear(H * d, d_model, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q = self.q(x).view(b, s, H, d)
            k, v = self.kv(x).view(b, s, 2, HKV, d).unbind(2)  # strided k/v views, read in place
            return self.o(ct.flash_attn_func(q, k, v, causal=True).reshape(b, s, H * d))

    torch.manual_seed(0)
    model = Block().cuda().to(torch.bfloat16)
    x = torch.randn(2, 192, d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    y = compiled(x)
    y.float().square().mean().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]

    x.grad = None
    model.zero_grad()
    y_eager = model(x)
    y_eager.float().square().mean().backward()
    want = [x.grad] + [p.grad for p in model.parameters()]
    _close_to_scale("y", y, y_eager, 2e-2)
    for i, (g, w) in enumerate(zip(got, want)):
        _close_to_scale(f"grad {i}", g, w, 5e-2)


def _close_to_scale(name, got, want, frac):
    """max |got - want| <= frac * max |want| (bf16 graphs compiled differently round differently)."""
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= frac * scale + 1e-6, f"{name}: max error {err:.3e} > {frac} * {scale:.3e}"


def test_torch_non_default_stream(torch, ct):
    """Kernels run on torch's current stream: a q written on a side stream after a long sleep is read
    correctly only if the attention is ordered after it on that same stream."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is missing")
    q, k, v = _torch_inputs(torch, 2, 200, 200, 64, requires_grad=False)
    expected = ct.flash_attn_func(q, k, v, causal=True)
    side = torch.cuda.Stream()
    assert side.cuda_stream != torch.cuda.current_stream().cuda_stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q2 = torch.full_like(q, float("nan"))
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time on the side stream
        q2.copy_(q)
        out = ct.flash_attn_func(q2, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)

    # and autograd on the side stream
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ct.flash_attn_func(qg, kg, vg, causal=True).float().sum().backward()
    torch.cuda.synchronize()
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    _sdpa_ref(torch, q64, k64, v64, True).sum().backward()
    g_low = ref.attention_ref_backward_lowp(_cupy(torch.ones_like(q)), _cupy(q), _cupy(k), _cupy(v), causal=True)
    for name, x, x64, gl in zip(("dq", "dk", "dv"), (qg, kg, vg), (q64, k64, v64), g_low):
        _check(name, x.grad, x64.grad, gl)


# --- torch: flash_attn_varlen_func -----------------------------------------------------------------

def _bounds(lens_q, lens_k):
    """[(b, q_start, q_end, k_start, k_end)] of packed sequences (host ints)."""
    cq = [0, *itertools.accumulate(lens_q)]
    ck = [0, *itertools.accumulate(lens_k)]
    return [(b, cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(lens_q))]


def _torch_varlen_inputs(torch, lens_q, lens_k, d, extra_rows=3, dtype=None, seed=0):
    """Packed q/k/v (with ``extra_rows`` rows after the last sequence, which belong to none) and the
    int32 offsets, all on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = dtype or torch.bfloat16
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32, device="cuda")

    def rand(*shape):
        x = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
        return x.requires_grad_()

    total_q, total_k = sum(lens_q) + extra_rows, sum(lens_k) + extra_rows
    return rand(total_q, H, d), rand(total_k, HKV, d), rand(total_k, HKV, d), cu_q, cu_k


def _first_visible_row(sq, sk, causal):
    """Rows before this one see no key (bottom-right causal with Sq > Sk, or no keys at all)."""
    if sk == 0:
        return sq
    return max(0, sq - sk) if causal else 0


def _varlen_sdpa_ref(torch, q, k, v, bounds, causal):
    """Per-sequence SDPA (math backend, fp64, bottom-right causal mask) over packed q/k/v; rows that
    see no key and rows after the last sequence are 0. Differentiable with respect to q, k and v. Only
    the rows that see a key go through SDPA (fully masked rows are NaN in some torch versions)."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for _, qs, qe, ks, ke in bounds:
        first = qs + _first_visible_row(qe - qs, ke - ks, causal)
        if first < qe:
            o = _sdpa_ref(torch, q[None, first:qe], k[None, ks:ke], v[None, ks:ke], causal)
            out = out.index_put((torch.arange(first, qe, device=q.device),), o[0])
    return out


VARLEN_LENS = [
    ([113, 0, 1, 239, 64], [239, 5, 1, 113, 64]),  # an empty and a length-1 sequence, Sq != Sk both ways
    ([1, 70, 1], [100, 0, 77]),  # an empty key sequence: its rows see nothing (out 0, lse -inf)
]


@pytest.mark.parametrize("custom_op", [True, False], ids=["custom_op", "autograd_function"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("lens", VARLEN_LENS)
def test_torch_varlen_forward_and_grads_vs_sdpa(torch, ct, custom_op, causal, d, lens):
    ct.use_custom_op(custom_op)
    lens_q, lens_k = lens
    bounds = _bounds(lens_q, lens_k)
    q, k, v, cu_q, cu_k = _torch_varlen_inputs(torch, lens_q, lens_k, d)
    out, lse = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                         return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (H, q.shape[0]) and lse.dtype == torch.float32
    assert out.requires_grad and not lse.requires_grad
    dout = torch.randn(q.shape, device="cuda", dtype=torch.float32,
                       generator=torch.Generator(device="cuda").manual_seed(5)).to(q.dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for g, like in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == like.shape and g.dtype == like.dtype

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    o_ref = _varlen_sdpa_ref(torch, q64, k64, v64, bounds, causal)
    g_ref = torch.autograd.grad(o_ref, (q64, k64, v64), dout.double())

    for b, qs, qe, ks, ke in bounds:
        if qe == qs:  # no queries: this sequence's keys get no gradient
            assert not dk[ks:ke].any() and not dv[ks:ke].any()
            continue
        if ke == ks:  # no keys: the rows see nothing
            assert not out[qs:qe].any() and not dq[qs:qe].any()
            assert bool((lse[:, qs:qe] == float("-inf")).all())
            continue
        qb, kb, vb, dob = (_cupy(x[None, s:e]) for x, s, e in ((q, qs, qe), (k, ks, ke), (v, ks, ke), (dout, qs, qe)))
        o_low, _ = ref.attention_ref_lowp(qb, kb, vb, causal=causal)
        _check(f"out[{b}]", out[None, qs:qe], o_ref[None, qs:qe], o_low)
        lse_ref = _lse_fp32(torch, q[None, qs:qe], k[None, ks:ke], causal)
        _check(f"lse[{b}]", lse[None, :, qs:qe], lse_ref, lse_ref, atol=2e-3)
        g_low = ref.attention_ref_backward_lowp(dob, qb, kb, vb, causal=causal)
        for name, g, gr, gl, s, e in (("dq", dq, g_ref[0], g_low[0], qs, qe), ("dk", dk, g_ref[1], g_low[1], ks, ke),
                                      ("dv", dv, g_ref[2], g_low[2], ks, ke)):
            _check(f"{name}[{b}]", g[None, s:e], gr[None, s:e], gl)
    # rows after the last sequence belong to none
    end_q, end_k = sum(lens_q), sum(lens_k)
    assert not out[end_q:].any() and not dq[end_q:].any()
    assert not dk[end_k:].any() and not dv[end_k:].any()
    assert bool((lse[:, end_q:] == float("-inf")).all())


def test_torch_varlen_switch_paths_agree(torch, ct):
    lens_q, lens_k = [50, 0, 90], [64, 7, 90]
    q, k, v, cu_q, cu_k = _torch_varlen_inputs(torch, lens_q, lens_k, 64)
    ct.use_custom_op(True)
    a = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 90, 90, causal=True)
    assert "cuflash_flash_attn_varlen_fwd" in type(a.grad_fn).__name__
    ct.use_custom_op(False)
    b = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 90, 90, causal=True)
    assert "FlashAttnVarlenFunction" in type(b.grad_fn).__name__
    assert torch.equal(a, b)  # same kernels, deterministic forward
    dout = torch.randn_like(a)
    ga = torch.autograd.grad(a, (q, k, v), dout)
    gb = torch.autograd.grad(b, (q, k, v), dout)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=2e-2, rtol=2e-2)  # dQ's fp32 atomics add in any order


def test_torch_varlen_opcheck(torch, ct):
    lens_q, lens_k = [64, 0, 37], [80, 5, 37]
    q, k, v, cu_q, cu_k = _torch_varlen_inputs(torch, lens_q, lens_k, 64)
    fwd = torch.ops.cuflash.flash_attn_varlen_fwd.default
    bwd = torch.ops.cuflash.flash_attn_varlen_bwd.default
    tol = dict(atol=2e-2, rtol=2e-2)  # without deterministic=True, dQ's fp32 atomics add in any order
    seed = torch.tensor(123456789, dtype=torch.int64)  # a CPU seed tensor, as flash_attn_varlen_func draws it
    base = (q, k, v, cu_q, cu_k, 64, 80)
    torch.library.opcheck(fwd, base + (None, True, -1, -1, 0.0, None, "auto", False, True), **tol)
    torch.library.opcheck(fwd, base + (0.2, False, 16, 8, 0.0, None, "auto", False, False), **tol)
    torch.library.opcheck(fwd, base + (None, True, -1, -1, 0.0, None, "auto", True, True, 0.17, seed, 0), **tol)
    with torch.no_grad():
        out, lse = fwd(*base, None, True, -1, -1, 0.0, None, "auto", False, True)
    dout = torch.randn_like(out)
    qd, kd, vd = (x.detach() for x in (q, k, v))
    bwd_base = (dout, qd, kd, vd, out, lse, cu_q, cu_k, 64, 80)
    torch.library.opcheck(bwd, bwd_base + (None, True, -1, -1, 0.0, None, "auto", False, False), **tol)
    torch.library.opcheck(bwd, bwd_base + (None, True, -1, -1, 0.0, None, "auto", True, True), **tol)


def test_torch_opcheck_with_dropout(torch, ct):
    q, k, v = _torch_inputs(torch, 1, 64, 96, 64)
    fwd, bwd = torch.ops.cuflash.flash_attn_fwd.default, torch.ops.cuflash.flash_attn_bwd.default
    tol = dict(atol=2e-2, rtol=2e-2)
    seed = torch.tensor(987654321, dtype=torch.int64)
    torch.library.opcheck(fwd, (q, k, v, None, True, -1, -1, 0.0, None, "auto", False, 0.17, seed, 0), **tol)
    with torch.no_grad():
        out, lse = fwd(q, k, v, None, True, -1, -1, 0.0, None, "auto", False, 0.17, seed, 0)
    dout = torch.randn_like(out)
    qd, kd, vd = (x.detach() for x in (q, k, v))
    torch.library.opcheck(bwd, (dout, qd, kd, vd, out, lse, None, True, -1, -1, 0.0, None, "auto", True, 0.17, seed,
                                0), **tol)


# --- torch: dropout ----------------------------------------------------------------------------------

_DROP_LENS = ([150, 0, 77, 1], [233, 9, 77, 40])


def _dropout_case(torch, ct, varlen, dropout_p=0.17, deterministic=True):
    """(inputs, f): f() runs the attention with dropout (causal, GQA), drawing its seed from torch's RNG."""
    if varlen:
        q, k, v, cu_q, cu_k = _torch_varlen_inputs(torch, *_DROP_LENS, 64, seed=3)

        def f():
            return ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(_DROP_LENS[0]), max(_DROP_LENS[1]), dropout_p,
                                             causal=True, deterministic=deterministic)
    else:
        q, k, v = _torch_inputs(torch, 2, 150, 233, 64, seed=3)

        def f():
            return ct.flash_attn_func(q, k, v, causal=True, deterministic=deterministic, dropout_p=dropout_p)
    return (q, k, v), f


@pytest.mark.parametrize("custom_op", [True, False], ids=["custom_op", "autograd_function"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_torch_dropout_reproducible_by_manual_seed(torch, ct, custom_op, varlen):
    """torch.manual_seed(s) fixes the dropout mask: the same seed gives bit-identical outputs and
    (deterministic=True) gradients, another seed other ones."""
    if not _backward_takes("deterministic"):
        pytest.skip("this cuflash's backward has no deterministic option")
    ct.use_custom_op(custom_op)
    (q, k, v), f = _dropout_case(torch, ct, varlen)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.float32,
                       generator=torch.Generator(device="cuda").manual_seed(11)).to(q.dtype)

    def run(manual_seed):
        torch.manual_seed(manual_seed)
        out = f()
        return out, torch.autograd.grad(out, (q, k, v), dout)

    a, b, c = run(1234), run(1234), run(4321)
    assert torch.equal(a[0], b[0])
    for x, y in zip(a[1], b[1]):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c[0])
    for x, y in zip(a[1], c[1]):
        assert not torch.equal(x, y)
    # dropout actually drops: the output differs from the one without dropout
    (_, no_dropout) = _dropout_case(torch, ct, varlen, dropout_p=0.0)
    assert not torch.equal(a[0], no_dropout())


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_torch_dropout_matches_reference_mask(torch, ct, varlen):
    """The seed the adapter draws after torch.manual_seed(s) is the first torch.randint of that state;
    with it cuflash.reference.dropout_mask predicts the mask, and the output and gradients match the
    reference attention with that mask (so the backward regenerated the forward's mask)."""
    import cupy

    p = 0.17
    (q, k, v), f = _dropout_case(torch, ct, varlen, dropout_p=p, deterministic=False)
    torch.manual_seed(2024)
    seed = int(ct._draw_dropout_seed())
    torch.manual_seed(2024)
    out = f()
    dout = torch.randn(q.shape, device="cuda", dtype=torch.float32,
                       generator=torch.Generator(device="cuda").manual_seed(12)).to(q.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    if varlen:
        lens_q, lens_k = _DROP_LENS
        keep_all = ref.dropout_mask(len(lens_q), H, max(lens_q), max(lens_k), p, seed, 0)
        pieces = [(b, slice(qs, qe), slice(ks, ke), keep_all[b:b + 1, :, :qe - qs, :ke - ks])
                  for b, qs, qe, ks, ke in _bounds(lens_q, lens_k) if qe > qs and ke > ks]
    else:
        keep = ref.dropout_mask(q.shape[0], H, q.shape[1], k.shape[1], p, seed, 0)
        pieces = [("all", slice(None), slice(None), keep)]
    for b, rows_q, rows_k, keep in pieces:
        sel = (lambda x, rows: x[None, rows]) if varlen else (lambda x, rows: x)
        qb, kb, vb = _cupy(sel(q, rows_q)), _cupy(sel(k, rows_k)), _cupy(sel(v, rows_k))
        dob = _cupy(sel(dout, rows_q))
        rkw = dict(causal=True, dropout_p=p, dropout_keep=cupy.asarray(np.ascontiguousarray(keep)))
        o_ref, _ = ref.attention_ref(qb, kb, vb, **rkw)
        o_low, _ = ref.attention_ref_lowp(qb, kb, vb, **rkw)
        _check(f"out[{b}]", sel(out, rows_q), o_ref, o_low)
        g_ref = ref.attention_ref_backward(dob, qb, kb, vb, **rkw)
        g_low = ref.attention_ref_backward_lowp(dob, qb, kb, vb, **rkw)
        for name, g, rows, gr, gl in zip(("dq", "dk", "dv"), grads, (rows_q, rows_k, rows_k), g_ref, g_low):
            _check(f"{name}[{b}]", sel(g, rows), gr, gl)


def test_torch_dropout_zero_draws_no_seed(torch, ct):
    q, k, v = _torch_inputs(torch, 1, 64, 64, 64, requires_grad=False)
    state = torch.get_rng_state()
    a = ct.flash_attn_func(q, k, v, causal=True, dropout_p=0.0)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, ct.flash_attn_func(q, k, v, causal=True))


# ------------------------------------------------------------------------------------------------
# JAX
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def jax():
    jax = pytest.importorskip("jax")
    if not any(dev.platform == "gpu" for dev in jax.devices()):
        pytest.skip("this JAX has no GPU backend")
    _need_impl()
    return jax


@pytest.fixture
def cj(jax):
    import cuflash.jax as cj

    return cj


def _jax_inputs(jax, b, sq, sk, d, seed=0):
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, sq, H, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, sk, HKV, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, sk, HKV, d), jnp.float32).astype(jnp.bfloat16)
    # loss weights, bf16-representable so that the bf16 cotangent the kernels see is exactly w
    w = jax.random.normal(keys[3], (b, sq, H, d), jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    return q, k, v, w


def _jnp_fp32(q, k, v, causal):
    """fp32 jnp attention with an explicit boolean mask (bottom-right causal), GQA by repetition."""
    import jax
    import jax.numpy as jnp

    sq, sk, h, hk, d = q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]
    kk = jnp.repeat(k.astype(jnp.float32), h // hk, axis=2)
    vv = jnp.repeat(v.astype(jnp.float32), h // hk, axis=2)
    exact = jax.lax.Precision.HIGHEST  # no TF32 in the reference
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kk, precision=exact) / math.sqrt(d)
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((sq, sk), dtype=bool), sk - sq), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), vv, precision=exact)


def _jax_check(jax, cj, q, k, v, w, causal, out, grads):
    import jax.numpy as jnp

    o_ref = _jnp_fp32(q, k, v, causal)
    g_ref = jax.grad(lambda q, k, v: (_jnp_fp32(q, k, v, causal) * w).sum(), argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    o_low, _ = ref.attention_ref_lowp(_cupy(q), _cupy(k), _cupy(v), causal=causal)
    g_low = ref.attention_ref_backward_lowp(_cupy(w.astype(jnp.bfloat16)), _cupy(q), _cupy(k), _cupy(v),
                                            causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    _check("out", out, o_ref, o_low)
    for name, g, gr, gl, like in zip(("dq", "dk", "dv"), grads, g_ref, g_low, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype
        _check(name, g, gr, gl)


def _loss(cj, causal, w):
    import jax.numpy as jnp

    return lambda q, k, v: (cj.flash_attn(q, k, v, causal=causal).astype(jnp.float32) * w).sum()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(128, 128), (113, 239)])
def test_jax_eager_forward_and_grad(jax, cj, causal, seqlens):
    q, k, v, w = _jax_inputs(jax, 2, *seqlens, 64)
    out = cj.flash_attn(q, k, v, causal=causal)
    grads = jax.grad(_loss(cj, causal, w), argnums=(0, 1, 2))(q, k, v)
    _jax_check(jax, cj, q, k, v, w, causal, out, grads)


@pytest.mark.parametrize("causal", [False, True])
def test_jax_jit_forward_and_grad(jax, cj, causal):
    if not cj.HAS_BUFFER_CALLBACK:
        pytest.skip(f"JAX {jax.__version__} has no jax.experimental.buffer_callback: no cuflash under jit")
    q, k, v, w = _jax_inputs(jax, 2, 113, 239, 128, seed=1)
    out = jax.jit(lambda q, k, v: cj.flash_attn(q, k, v, causal=causal))(q, k, v)
    grads = jax.jit(jax.grad(_loss(cj, causal, w), argnums=(0, 1, 2)))(q, k, v)
    _jax_check(jax, cj, q, k, v, w, causal, out, grads)
    # the same kernels eagerly: the forward is deterministic
    assert bool((out == cj.flash_attn(q, k, v, causal=causal)).all())


def test_jax_jit_deterministic_grads(jax, cj):
    if not cj.HAS_BUFFER_CALLBACK:
        pytest.skip(f"JAX {jax.__version__} has no jax.experimental.buffer_callback: no cuflash under jit")
    if not _backward_takes("deterministic"):
        pytest.skip("this cuflash's backward has no deterministic option")
    q, k, v, w = _jax_inputs(jax, 2, 300, 300, 64, seed=3)

    def loss(q, k, v):
        return (cj.flash_attn(q, k, v, causal=True, deterministic=True).astype("float32") * w).sum()

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    first, second = f(q, k, v), f(q, k, v)
    eager = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for a, b, c in zip(first, second, eager):
        assert bool((a == b).all()) and bool((a == c).all())


def test_jax_jit_vmap_and_value_and_grad(jax, cj):
    """vmap folds into the batch axis; value_and_grad under jit; the callback on XLA's stream is
    ordered with the surrounding XLA ops (inputs computed in the same program)."""
    if not cj.HAS_BUFFER_CALLBACK:
        pytest.skip(f"JAX {jax.__version__} has no jax.experimental.buffer_callback: no cuflash under jit")
    import jax.numpy as jnp

    q, k, v, w = _jax_inputs(jax, 6, 100, 100, 64, seed=2)

    @jax.jit
    def batched(q, k, v):
        qs, ks, vs = ((x * 1.0).reshape((3, 2) + x.shape[1:]) for x in (q, k, v))  # produced in-program
        return jax.vmap(lambda q, k, v: cj.flash_attn(q, k, v, causal=True))(qs, ks, vs).reshape(q.shape)

    got = batched(q, k, v)
    assert bool((got == cj.flash_attn(q, k, v, causal=True)).all())

    f = jax.jit(jax.value_and_grad(_loss(cj, True, w), argnums=(0, 1, 2)))
    val, grads = f(q, k, v)
    assert np.isfinite(float(val))
    _jax_check(jax, cj, q, k, v, w, True, cj.flash_attn(q, k, v, causal=True), grads)
    assert grads[0].dtype == jnp.bfloat16
