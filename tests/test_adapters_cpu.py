"""cuflash.torch / cuflash.jax without a GPU: imports, the custom-op switch, fake implementations,
argument handling, and the autograd / torch.compile / custom_vjp / jit plumbing with the cuflash
calls replaced by CPU references (the kernels themselves are tested in test_adapters_gpu.py).

Tests that need torch or JAX skip when it is not installed.
"""
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_python(code: str, env_extra: dict | None = None, env_drop=()) -> str:
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env.update(env_extra or {})
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_import_cuflash_imports_neither_torch_nor_jax():
    out = _run_python("""
        import sys
        import cuflash, cuflash.api
        print(sorted(m for m in ("torch", "jax", "jaxlib") if m in sys.modules))
    """)
    assert out == "[]"


# ------------------------------------------------------------------------------------------------
# torch
# ------------------------------------------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch")


def _ref_forward_torch(q, k, v, softmax_scale, causal, window_left, window_right):
    """fp32 attention with cuflash's masks: (out, lse, p) for q (B, Sq, H, D), k/v (B, Sk, Hkv, D)."""
    import torch

    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kk = k.float().repeat_interleave(h // hk, dim=2)
    vv = v.float().repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) * scale
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if window_left >= 0:
        keep &= j >= i - window_left
    right = 0 if causal else window_right
    if right >= 0:
        keep &= j <= i + right
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    return out, lse, p


def _fake_forward(q, k, v, softmax_scale, causal, window_left, window_right):
    out, lse, _ = _ref_forward_torch(q, k, v, softmax_scale, causal, window_left, window_right)
    return out.to(q.dtype).contiguous(), lse.float().contiguous()


def _fake_backward(dout, q, k, v, softmax_scale, causal, window_left, window_right):
    """The analytic attention backward in fp32 (what cuflash's kernels compute)."""
    import torch

    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    o, _, p = _ref_forward_torch(q, k, v, softmax_scale, causal, window_left, window_right)
    do = dout.float()
    kk = k.float().repeat_interleave(g, dim=2)
    vv = v.float().repeat_interleave(g, dim=2)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vv)
    delta = (do * o).sum(-1).permute(0, 2, 1)  # (b, h, sq)
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float()) * scale
    dk = dk.reshape(b, sk, hk, g, d).sum(3)
    dv = dv.reshape(b, sk, hk, g, d).sum(3)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()


class _FakeApi:
    """Stand-ins for cuflash.flash_attn_func / flash_attn_backward on CPU tensors; they record what
    they were given."""

    def __init__(self):
        self.calls = []

    def flash_attn_func(self, q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, return_lse=False, impl="auto"):
        self.calls.append(("forward", dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                           softcap=softcap, impl=impl, return_lse=return_lse)))
        out, lse = _fake_forward(q, k, v, softmax_scale, causal, *window_size)
        return (out, lse) if return_lse else out

    def flash_attn_backward(self, dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                            window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                            impl="auto"):
        self.calls.append(("backward", dict(dout_stride=tuple(dout.stride()), dout_ptr=dout.data_ptr(),
                                            causal=causal, window_size=window_size, impl=impl,
                                            softcap=softcap, deterministic=deterministic)))
        return _fake_backward(dout, q, k, v, softmax_scale, causal, *window_size)


@pytest.fixture
def cpu_attention(monkeypatch):
    """cuflash.torch with cuflash's two public functions replaced by the CPU references above."""
    _torch()
    import cuflash.torch as ct

    fake = _FakeApi()
    monkeypatch.setattr(ct._api, "flash_attn_func", fake.flash_attn_func)
    monkeypatch.setattr(ct._api, "flash_attn_backward", fake.flash_attn_backward)
    previous = ct.use_custom_op(True)
    ct.fake_api = fake
    yield ct
    del ct.fake_api
    ct.use_custom_op(previous)


def _qkv(torch, b=2, sq=5, sk=7, h=4, hk=2, d=8, dtype=None, requires_grad=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype).requires_grad_(requires_grad)

    return rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d)


def _sdpa_reference(torch, q, k, v, causal):
    """The math the GPU tests compare against: SDPA in fp32 with an explicit boolean mask."""
    sq, sk, h, hk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq) if causal else None
    qt, kt, vt = (x.float().transpose(1, 2) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(h // hk, dim=1), vt.repeat_interleave(h // hk, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)


def test_torch_module_imports_and_registers_ops():
    torch = _torch()
    import cuflash.torch as ct

    assert ct.custom_op_enabled() is ct._switch_from_env()
    ct.use_custom_op(True)
    assert hasattr(torch.ops.cuflash, "flash_attn_fwd") and hasattr(torch.ops.cuflash, "flash_attn_bwd")
    schema = str(torch.ops.cuflash.flash_attn_fwd.default._schema)
    assert schema.startswith("cuflash::flash_attn_fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale")
    assert schema.endswith("-> (Tensor, Tensor)")


@pytest.mark.parametrize("value", ["0", "false", "OFF"])
def test_torch_env_switch_off_leaves_ops_unregistered(value):
    _torch()
    out = _run_python("""
        import torch, cuflash.torch as ct
        print(ct.custom_op_enabled(), hasattr(torch.ops.cuflash, "flash_attn_fwd"))
        ct.use_custom_op(True)
        print(ct.custom_op_enabled(), hasattr(torch.ops.cuflash, "flash_attn_fwd"))
    """, {"CUFLASH_TORCH_CUSTOM_OP": value})
    assert out.splitlines() == ["False False", "True True"]


def test_torch_env_switch_default_on():
    _torch()
    out = _run_python("""
        import torch, cuflash.torch as ct
        print(ct.custom_op_enabled(), hasattr(torch.ops.cuflash, "flash_attn_fwd"))
    """, env_drop=("CUFLASH_TORCH_CUSTOM_OP",))
    assert out == "True True"


def test_torch_use_custom_op_returns_previous_and_checks_type():
    _torch()
    import cuflash.torch as ct

    start = ct.custom_op_enabled()
    try:
        ct.use_custom_op(True)
        assert ct.use_custom_op(False) is True
        assert ct.custom_op_enabled() is False
        assert ct.use_custom_op(True) is False
        assert ct.custom_op_enabled() is True
        with pytest.raises(TypeError, match="bool"):
            ct.use_custom_op(1)
    finally:
        ct.use_custom_op(start)


def test_torch_fake_implementations_shapes():
    torch = _torch()
    from torch._subclasses.fake_tensor import FakeTensorMode

    import cuflash.torch as ct

    ct.use_custom_op(True)
    fwd, bwd = torch.ops.cuflash.flash_attn_fwd.default, torch.ops.cuflash.flash_attn_bwd.default
    with FakeTensorMode():
        # a non-contiguous q (heads-major storage): the outputs are contiguous all the same
        q = torch.empty(3, 8, 37, 64, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.empty(3, 50, 2, 64, dtype=torch.bfloat16)
        v = torch.empty(3, 50, 2, 64, dtype=torch.bfloat16)
        out, lse = fwd(q, k, v, None, True, -1, -1, 0.0, None, "auto", False)
        assert out.shape == (3, 37, 8, 64) and out.dtype == torch.bfloat16 and out.is_contiguous()
        assert lse.shape == (3, 8, 37) and lse.dtype == torch.float32 and lse.is_contiguous()
        dq, dk, dv = bwd(out, q, k, v, out, lse, 0.125, False, 16, 0, 0.0, None, "fa1", True)
        assert dq.shape == q.shape and dq.dtype == q.dtype and dq.is_contiguous()
        assert dk.shape == dv.shape == k.shape and dk.dtype == dv.dtype == torch.bfloat16


def test_torch_fake_tensor_mode_through_public_function():
    torch = _torch()
    from torch._subclasses.fake_tensor import FakeTensorMode

    import cuflash.torch as ct

    ct.use_custom_op(True)
    with FakeTensorMode():
        q = torch.empty(1, 9, 6, 32, dtype=torch.float16)
        k = v = torch.empty(1, 4, 3, 32, dtype=torch.float16)
        out, lse = ct.flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert out.shape == q.shape and lse.shape == (1, 6, 9)


@pytest.mark.parametrize("window_size", [(1, 2, 3), 4, (1.0, 2), (True, -1), "ab"])
def test_torch_window_size_type(window_size):
    torch = _torch()
    import cuflash.torch as ct

    q, k, v = _qkv(torch, requires_grad=False)
    with pytest.raises(TypeError, match="window_size"):
        ct.flash_attn_func(q, k, v, window_size=window_size)


def test_torch_option_types():
    torch = _torch()
    import cuflash.torch as ct

    q, k, v = _qkv(torch, requires_grad=False)
    with pytest.raises(TypeError, match="causal"):
        ct.flash_attn_func(q, k, v, causal=1)
    with pytest.raises(TypeError, match="deterministic"):
        ct.flash_attn_func(q, k, v, deterministic=None)
    with pytest.raises(TypeError, match="bool"):
        ct.flash_attn_func(q, k, v, softmax_scale=True)


@pytest.mark.parametrize("custom_op", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_autograd_plumbing(cpu_attention, custom_op, causal):
    torch = _torch()
    ct = cpu_attention
    ct.use_custom_op(custom_op)
    q, k, v = _qkv(torch, sq=5, sk=9)
    out, lse = ct.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert not lse.requires_grad and out.requires_grad
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = _sdpa_reference(torch, q2, k2, v2, causal)
    rq, rk, rv = torch.autograd.grad(ref, (q2, k2, v2), dout)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in ((dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("custom_op", [True, False])
def test_torch_backward_gets_a_readable_dout(cpu_attention, custom_op):
    torch = _torch()
    ct = cpu_attention
    ct.use_custom_op(custom_op)
    calls = ct.fake_api.calls
    q, k, v = _qkv(torch)
    contiguous = (5 * 4 * 8, 4 * 8, 8, 1)
    ct.flash_attn_func(q, k, v).sum().backward()  # dout is a broadcast (all strides 0)
    assert calls[-1][0] == "backward" and calls[-1][1]["dout_stride"] == contiguous
    out = ct.flash_attn_func(q, k, v)
    big = torch.randn(out.shape[0], out.shape[1], out.shape[2], 2 * out.shape[3])
    (out * big[..., ::2]).sum().backward()  # dout = big[..., ::2]: last-dim stride 2
    assert calls[-1][1]["dout_stride"] == contiguous
    out = ct.flash_attn_func(q, k, v)
    good = torch.randn(out.shape[0], out.shape[2], out.shape[1], out.shape[3]).transpose(1, 2)
    out.backward(good)  # a layout the kernels read: passed as it is
    assert calls[-1][1]["dout_stride"] == good.stride() and calls[-1][1]["dout_ptr"] == good.data_ptr()


def test_torch_options_reach_cuflash(cpu_attention, monkeypatch):
    torch = _torch()
    ct = cpu_attention
    calls = ct.fake_api.calls

    class NoBackward:
        BWD_FEATURES = None

    monkeypatch.setattr(ct._api, "_FAMILIES", {"fa1": object(), "fa2": NoBackward})
    q, k, v = _qkv(torch, sq=7, sk=7)
    for custom_op in (True, False):
        ct.use_custom_op(custom_op)
        out = ct.flash_attn_func(q, k, v, 0.25, True, (3, 5), impl="fa2", deterministic=True)
        out.sum().backward()
        fwd, bwd = calls[-2][1], calls[-1][1]
        assert fwd == dict(causal=True, softmax_scale=0.25, window_size=(3, 5), softcap=0.0, impl="fa2",
                           return_lse=True)
        assert bwd["causal"] is True and bwd["window_size"] == (3, 5) and bwd["impl"] == "auto"
        assert bwd["deterministic"] is True and bwd["softcap"] == 0.0
        ct.flash_attn_func(q, k, v, softcap=30, impl="fa1")
        assert calls[-1][1]["softcap"] == 30.0 and calls[-1][1]["impl"] == "fa1"


def test_torch_kernel_readable_keeps_good_layouts():
    torch = _torch()
    import cuflash.torch as ct

    base = torch.randn(2, 16, 4, 64)
    assert ct._kernel_readable(base) is base
    permuted = torch.randn(2, 4, 16, 64).transpose(1, 2)  # strides multiple of 8, last dim contiguous
    assert ct._kernel_readable(permuted) is permuted
    odd = torch.randn(2, 16, 5, 64 + 3)[..., :64]  # head stride 67: not a multiple of 8
    fixed = ct._kernel_readable(odd)
    assert fixed is not odd and fixed.is_contiguous() and torch.equal(fixed, odd)
    shifted = torch.randn(2 * 16 * 4 * 64 + 1)[1:].view(2, 16, 4, 64)  # starts 4 bytes in
    fixed = ct._kernel_readable(shifted)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, shifted)


def test_torch_standard_contiguous():
    torch = _torch()
    import cuflash.torch as ct

    t = torch.randn(2, 3, 4, 8)
    assert ct._standard_contiguous(t) is t
    p = torch.randn(2, 4, 3, 8).transpose(1, 2)
    s = ct._standard_contiguous(p)
    assert s.stride() == (96, 32, 8, 1) and torch.equal(s, p)
    odd = torch.empty_strided((2, 1, 4, 8), (32, 1, 8, 1))  # size-1 dim with a non-standard stride
    assert ct._standard_contiguous(odd).stride() == (32, 32, 8, 1)


def test_torch_opcheck_with_cpu_reference(cpu_attention):
    torch = _torch()
    q, k, v = _qkv(torch)
    fwd, bwd = torch.ops.cuflash.flash_attn_fwd.default, torch.ops.cuflash.flash_attn_bwd.default
    torch.library.opcheck(fwd, (q, k, v, None, True, -1, -1, 0.0, None, "auto", False))
    torch.library.opcheck(fwd, (q, k, v, 0.3, False, 3, 1, 0.0, None, "auto", True))
    with torch.no_grad():
        out, lse = fwd(q, k, v, None, True, -1, -1, 0.0, None, "auto", False)
    dout = torch.randn_like(out)
    qd, kd, vd = (x.detach() for x in (q, k, v))
    torch.library.opcheck(bwd, (dout, qd, kd, vd, out, lse, None, True, -1, -1, 0.0, None, "auto", False))


def test_torch_compile_fullgraph_with_cpu_reference(cpu_attention):
    torch = _torch()
    ct = cpu_attention

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 32)

        def forward(self, q, k, v):
            o = ct.flash_attn_func(q, k, v, causal=True, window_size=(4, 0))
            return self.proj(o.flatten(2))

    torch.manual_seed(0)
    model = Block()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    q, k, v = _qkv(torch, sq=6, sk=6, h=4, hk=2, d=8)
    y = compiled(q, k, v)
    y.square().sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    y2 = model(q2, k2, v2)
    y2.square().sum().backward()
    torch.testing.assert_close(y, y2)
    for got, x in zip(grads, (q2, k2, v2)):
        torch.testing.assert_close(got, x.grad)


def test_torch_backward_extras(monkeypatch):
    torch = _torch()
    import cuflash.torch as ct

    def old_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                     impl="auto"):
        raise AssertionError("not called")

    def new_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                     softcap=0.0, alibi_slopes=None, deterministic=False, impl="auto"):
        raise AssertionError("not called")

    monkeypatch.setattr(ct._api, "flash_attn_backward", old_backward)
    assert ct._backward_extras(0.0, None) == {}
    with pytest.raises(ValueError, match="softcap"):
        ct._backward_extras(30.0, None)
    with pytest.raises(ValueError, match="alibi_slopes"):
        ct._backward_extras(0.0, torch.ones(4))
    with pytest.raises(ValueError, match="deterministic"):
        ct._backward_extras(0.0, None, True)
    monkeypatch.setattr(ct._api, "flash_attn_backward", new_backward)
    slopes = torch.ones(4)
    extras = ct._backward_extras(30.0, slopes, True)
    assert extras == {"softcap": 30.0, "alibi_slopes": slopes, "deterministic": True}


def test_torch_backward_impl_falls_back_when_family_has_no_backward(monkeypatch):
    _torch()
    import cuflash.torch as ct

    class NoBackward:
        BWD_FEATURES = None

    class WithBackward:
        BWD_FEATURES = frozenset({"causal"})

    monkeypatch.setattr(ct._api, "_FAMILIES", {"x": NoBackward, "y": WithBackward})
    assert ct._backward_impl("x") == "auto"
    assert ct._backward_impl("y") == "y"
    assert ct._backward_impl("auto") == "auto"


def test_torch_cpu_tensors_are_refused_by_cuflash():
    torch = _torch()
    pytest.importorskip("cupy")
    import cuflash.torch as ct

    q, k, v = _qkv(torch, dtype=torch.float16, requires_grad=False)
    for custom_op in (True, False):
        previous = ct.use_custom_op(custom_op)
        try:
            with pytest.raises(TypeError, match="CUDA device memory"):
                ct.flash_attn_func(q, k, v)
        finally:
            ct.use_custom_op(previous)


# ------------------------------------------------------------------------------------------------
# JAX
# ------------------------------------------------------------------------------------------------

def _jax():
    return pytest.importorskip("jax")


def _ref_attention_np(q, k, v, opts):
    """float64 numpy attention: (out, lse, p) with cuflash's masks."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = opts.softmax_scale if opts.softmax_scale is not None else 1.0 / math.sqrt(d)
    kk, vv = np.repeat(k, h // hk, axis=2), np.repeat(v, h // hk, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    i = np.arange(sq)[:, None] + (sk - sq)
    j = np.arange(sk)[None, :]
    keep = np.ones((sq, sk), dtype=bool)
    left, right = opts.window_size
    if left >= 0:
        keep &= j >= i - left
    right = 0 if opts.causal else right
    if right >= 0:
        keep &= j <= i + right
    s = np.where(keep, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    tot = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(tot > 0, e / tot, 0.0)
        lse = np.where(tot[..., 0] > 0, np.log(tot[..., 0]) + m[..., 0], -np.inf)
    return np.einsum("bhqk,bkhd->bqhd", p, vv), lse, p, scale, kk, vv


def _np_forward_into(qa, ka, va, out, lse, opts):
    o, l, *_ = _ref_attention_np(qa, ka, va, opts)
    out[...] = o.astype(out.dtype)
    lse[...] = l.astype(lse.dtype)


def _np_backward_into(dout, qa, ka, va, oa, lse, dq, dk, dv, opts):
    o, _, p, scale, kk, vv = _ref_attention_np(qa, ka, va, opts)
    do = np.asarray(dout, dtype=np.float64)
    b, sq, h, d = do.shape
    sk, hk = ka.shape[1], ka.shape[2]
    g = h // hk
    dvf = np.einsum("bhqk,bqhd->bkhd", p, do)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vv)
    delta = (do * o).sum(-1).transpose(0, 2, 1)
    ds = p * (dp - delta[..., None])
    dq[...] = (np.einsum("bhqk,bkhd->bqhd", ds, kk) * scale).astype(dq.dtype)
    dkf = np.einsum("bhqk,bqhd->bkhd", ds, np.asarray(qa, dtype=np.float64)) * scale
    dk[...] = dkf.reshape(b, sk, hk, g, d).sum(3).astype(dk.dtype)
    dv[...] = dvf.reshape(b, sk, hk, g, d).sum(3).astype(dv.dtype)


@pytest.fixture
def jax_cpu_callbacks(monkeypatch):
    """cuflash.jax's buffer callbacks on the CPU backend, numpy references in place of cuflash."""
    _jax()
    import contextlib

    import cuflash.jax as cj

    if not cj.HAS_BUFFER_CALLBACK:
        pytest.skip("this JAX has no jax.experimental.buffer_callback")
    monkeypatch.setattr(cj, "_device_view", np.asarray)
    monkeypatch.setattr(cj, "_callback_scope", lambda ctx, buf: contextlib.nullcontext())
    monkeypatch.setattr(cj, "_forward_into", _np_forward_into)
    monkeypatch.setattr(cj, "_backward_into", _np_backward_into)
    return cj


def _jax_inputs(b=2, sq=5, sk=9, h=4, hk=2, d=8, dtype="float16", seed=0):
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s).astype(dtype))
                 for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))


def _jnp_reference(q, k, v, causal, window_size=(-1, -1), softmax_scale=None):
    import jax.numpy as jnp

    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kk, vv = jnp.repeat(k, h // hk, axis=2), jnp.repeat(v, h // hk, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kk.astype(jnp.float32)) * scale
    i = jnp.arange(sq)[:, None] + (sk - sq)
    j = jnp.arange(sk)[None, :]
    keep = jnp.ones((sq, sk), dtype=bool)
    left, right = window_size
    if left >= 0:
        keep &= j >= i - left
    right = 0 if causal else right
    if right >= 0:
        keep &= j <= i + right
    s = jnp.where(keep, s, -jnp.inf)
    p = jax_softmax(s)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vv.astype(jnp.float32))


def jax_softmax(s):
    import jax

    return jax.nn.softmax(s, axis=-1)


def test_jax_jit_forward_and_grad_plumbing(jax_cpu_callbacks):
    jax = _jax()
    import jax.numpy as jnp

    cj = jax_cpu_callbacks
    q, k, v = _jax_inputs()
    for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (2, 1))):
        f = jax.jit(lambda q, k, v: cj.flash_attn(q, k, v, causal=causal, window_size=window))
        np.testing.assert_allclose(f(q, k, v).astype(np.float32), _jnp_reference(q, k, v, causal, window),
                                   atol=2e-3, rtol=2e-3)

        def loss(q, k, v, fn):
            return (fn(q, k, v).astype(jnp.float32) * jnp.cos(jnp.arange(q.size).reshape(q.shape))).sum()

        got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(
            q, k, v, lambda q, k, v: cj.flash_attn(q, k, v, causal=causal, window_size=window))
        want = jax.grad(loss, argnums=(0, 1, 2))(
            q, k, v, lambda q, k, v: _jnp_reference(q, k, v, causal, window))
        for g, w in zip(got, want):
            assert g.dtype == jnp.float16
            np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), atol=1e-2, rtol=1e-2)


def test_jax_vmap_folds_into_batch(jax_cpu_callbacks):
    jax = _jax()
    import jax.numpy as jnp

    cj = jax_cpu_callbacks
    q, k, v = _jax_inputs(b=6)
    qs, ks, vs = (x.reshape((3, 2) + x.shape[1:]) for x in (q, k, v))
    f = jax.jit(jax.vmap(lambda q, k, v: cj.flash_attn(q, k, v, causal=True)))
    got = f(qs, ks, vs)
    assert got.shape == qs.shape and got.dtype == jnp.float16
    np.testing.assert_allclose(got.reshape(q.shape).astype(np.float32), _jnp_reference(q, k, v, True),
                               atol=2e-3, rtol=2e-3)
    # k/v shared across the mapped axis (broadcast before the callback), and grads through vmap
    def loss(fn):
        return lambda qs: jax.vmap(lambda q: fn(q, k[:2], v[:2]))(qs).astype(jnp.float32).sum()

    g = jax.jit(jax.grad(loss(cj.flash_attn)))(qs)
    want = jax.grad(loss(lambda q, k, v: _jnp_reference(q, k, v, False)))(qs)
    assert g.shape == qs.shape
    np.testing.assert_allclose(g.astype(np.float32), want.astype(np.float32), atol=1e-2, rtol=1e-2)


def test_jax_eval_shape_and_dtype():
    jax = _jax()
    import jax.numpy as jnp

    import cuflash.jax as cj

    if not cj.HAS_BUFFER_CALLBACK:
        pytest.skip("this JAX has no jax.experimental.buffer_callback")
    q = jax.ShapeDtypeStruct((2, 33, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 40, 2, 64), jnp.bfloat16)
    out = jax.eval_shape(lambda q, k, v: cj.flash_attn(q, k, v, causal=True), q, kv, kv)
    assert out.shape == (2, 33, 8, 64) and out.dtype == jnp.bfloat16
    grads = jax.eval_shape(jax.grad(lambda q, k, v: cj.flash_attn(q, k, v).astype(jnp.float32).sum(),
                                    argnums=(0, 1, 2)), q, kv, kv)
    assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape]
    assert all(g.dtype == jnp.bfloat16 for g in grads)


@pytest.mark.parametrize("kwargs, shapes, exc, match", [
    ({}, ((2, 8, 4), (2, 8, 4, 64), (2, 8, 4, 64)), ValueError, "4 dimensions"),
    ({}, ((2, 8, 4, 64), (2, 8, 3, 64), (2, 8, 3, 64)), ValueError, "multiple of the number of KV heads"),
    ({}, ((2, 8, 4, 64), (2, 8, 4, 32), (2, 8, 4, 32)), ValueError, "head dim"),
    ({"window_size": (1, 2, 3)}, None, TypeError, "window_size"),
    ({"causal": 1}, None, TypeError, "causal"),
    ({"softmax_scale": -1.0}, None, ValueError, "softmax_scale"),
    ({"impl": "fa9"}, None, ValueError, "impl must be one of"),
    ({"deterministic": 1}, None, TypeError, "deterministic"),
])
def test_jax_argument_checks_at_trace_time(kwargs, shapes, exc, match):
    jax = _jax()
    import jax.numpy as jnp

    import cuflash.jax as cj

    shapes = shapes or ((2, 8, 4, 64), (2, 8, 2, 64), (2, 8, 2, 64))
    args = [jax.ShapeDtypeStruct(s, jnp.float16) for s in shapes]
    with pytest.raises(exc, match=match):
        jax.eval_shape(lambda q, k, v: cj.flash_attn(q, k, v, **kwargs), *args)


def test_jax_dtype_check():
    jax = _jax()
    import jax.numpy as jnp

    import cuflash.jax as cj

    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((1, 8, 2, 64), (1, 8, 2, 64), (1, 8, 2, 64))]
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        jax.eval_shape(cj.flash_attn, *args)


def test_jax_without_buffer_callback_raises_clearly_under_jit(monkeypatch):
    jax = _jax()
    import jax.numpy as jnp

    import cuflash.jax as cj

    monkeypatch.setattr(cj, "_buffer_callback", None)
    args = [jax.ShapeDtypeStruct((1, 8, 2, 64), jnp.float16)] * 3
    with pytest.raises(RuntimeError, match="buffer_callback"):
        jax.eval_shape(cj.flash_attn, *args)


def test_jax_eager_cpu_arrays_are_refused_by_cuflash():
    _jax()
    pytest.importorskip("cupy")
    import cuflash.jax as cj

    q, k, v = _jax_inputs(dtype="float16")
    if next(iter(q.devices())).platform != "cpu":
        pytest.skip("this test wants JAX's CPU backend")
    with pytest.raises(TypeError, match="CUDA device memory"):
        cj.flash_attn(q, k, v)


def test_jax_cpu_buffers_under_jit_are_refused(monkeypatch):
    jax = _jax()
    import cuflash.jax as cj

    if not cj.HAS_BUFFER_CALLBACK:
        pytest.skip("this JAX has no jax.experimental.buffer_callback")
    q, k, v = _jax_inputs(dtype="float16")
    if next(iter(q.devices())).platform != "cpu":
        pytest.skip("this test wants JAX's CPU backend")
    import contextlib

    monkeypatch.setattr(cj, "_callback_scope", lambda ctx, buf: contextlib.nullcontext())
    with pytest.raises(Exception, match="needs its arrays on a CUDA GPU"):
        jax.block_until_ready(jax.jit(cj.flash_attn)(q, k, v))


def test_jax_stream_handle_protocol():
    _jax()
    cupy = pytest.importorskip("cupy")
    import cuflash.jax as cj

    assert cj._StreamHandle(1234).__cuda_stream__() == (0, 1234)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        s = cj._cupy_stream(1234, 0)
    assert s.ptr == 1234
    assert isinstance(s, cupy.cuda.Stream) or isinstance(s, cupy.cuda.ExternalStream)


def test_jax_backward_kwargs():
    _jax()
    import cuflash.jax as cj

    opts = cj._Options(True, 0.5, (3, 0), "auto")
    assert cj._backward_kwargs(opts) == dict(causal=True, softmax_scale=0.5, window_size=(3, 0), impl="auto")
    assert cj._backward_kwargs(opts._replace(deterministic=True))["deterministic"] is True


def test_jax_fold_helpers():
    _jax()
    import cuflash.jax as cj

    a = np.zeros((3, 2, 5, 4, 8))
    assert cj._fold_bshd(a).shape == (6, 5, 4, 8)
    assert cj._fold_bshd(a[0]).shape == (2, 5, 4, 8)
    assert cj._fold_bhs(np.zeros((3, 2, 4, 5))).shape == (6, 4, 5)
    assert cj._fold_bhs(np.zeros((2, 4, 5))).shape == (2, 4, 5)
