"""cuflash.torch / cuflash.jax without a GPU: imports, the custom-op switch, fake implementations,
argument handling, and the autograd / torch.compile / custom_vjp / jit plumbing with the cuflash
calls replaced by CPU references (the kernels themselves are tested in test_adapters_gpu.py).

Tests that need torch or JAX skip when it is not installed.
"""
import itertools
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


def _ref_forward_torch(q, k, v, softmax_scale, causal, window_left, window_right, keep=None, dropout_p=0.0):
    """fp32 attention with cuflash's masks: (out, lse, p) for q (B, Sq, H, D), k/v (B, Sk, Hkv, D); p is
    the undropped softmax, out uses p * keep / (1 - dropout_p) when a keep mask (B, H, Sq, Sk) is given."""
    import torch

    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kk = k.float().repeat_interleave(h // hk, dim=2)
    vv = v.float().repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) * scale
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    keep_mask = torch.ones(sq, sk, dtype=torch.bool)
    if window_left >= 0:
        keep_mask &= j >= i - window_left
    right = 0 if causal else window_right
    if right >= 0:
        keep_mask &= j <= i + right
    s = s.masked_fill(~keep_mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", _dropped(p, keep, dropout_p), vv)
    return out, lse, p


def _dropped(x, keep, dropout_p):
    return x if keep is None else x * keep / (1.0 - dropout_p)


def _fake_forward(q, k, v, softmax_scale, causal, window_left, window_right, keep=None, dropout_p=0.0):
    out, lse, _ = _ref_forward_torch(q, k, v, softmax_scale, causal, window_left, window_right, keep, dropout_p)
    return out.to(q.dtype).contiguous(), lse.float().contiguous()


def _fake_backward(dout, q, k, v, softmax_scale, causal, window_left, window_right, keep=None, dropout_p=0.0):
    """The analytic attention backward in fp32 (what cuflash's kernels compute), dropout included."""
    import torch

    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    o, _, p = _ref_forward_torch(q, k, v, softmax_scale, causal, window_left, window_right, keep, dropout_p)
    do = dout.float()
    kk = k.float().repeat_interleave(g, dim=2)
    vv = v.float().repeat_interleave(g, dim=2)
    dv = torch.einsum("bhqk,bqhd->bkhd", _dropped(p, keep, dropout_p), do)
    dp = _dropped(torch.einsum("bqhd,bkhd->bhqk", do, vv), keep, dropout_p)
    delta = (do * o).sum(-1).permute(0, 2, 1)  # (b, h, sq)
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float()) * scale
    dk = dk.reshape(b, sk, hk, g, d).sum(3)
    dv = dv.reshape(b, sk, hk, g, d).sum(3)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()


def _fake_keep(seed, offset, shape, p, index=0):
    """The fakes' dropout mask: a function of (seed, offset, sequence index) like cuflash's Philox mask."""
    import torch

    gen = torch.Generator().manual_seed((seed + 1_000_003 * offset + 7_919 * index) % 2 ** 63)
    return torch.rand(shape, generator=gen) >= p


_NO_DROPOUT = object()  # the fakes' default: tells "not passed" from "passed as 0"


def _fake_dropout(dropout_p, dropout_seed, dropout_offset):
    """(record, p): the dropout arguments as the fakes record them (None when not passed)."""
    if dropout_p is _NO_DROPOUT:
        assert dropout_seed is _NO_DROPOUT and dropout_offset is _NO_DROPOUT
        return None, 0.0
    assert isinstance(dropout_seed, int) and isinstance(dropout_offset, int)
    return (dropout_p, dropout_seed, dropout_offset), dropout_p


def _sequences(cu_seqlens_q, cu_seqlens_k):
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(b, cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


class _FakeApi:
    """Stand-ins for cuflash's four public functions on CPU tensors; they record what they were given."""

    def __init__(self):
        self.calls = []

    def flash_attn_func(self, q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, return_lse=False, impl="auto", dropout_p=_NO_DROPOUT,
                        dropout_seed=_NO_DROPOUT, dropout_offset=_NO_DROPOUT):
        record = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, impl=impl,
                      return_lse=return_lse)
        dropout, p = _fake_dropout(dropout_p, dropout_seed, dropout_offset)
        keep = None
        if dropout is not None:
            record["dropout"] = dropout
            keep = _fake_keep(dropout_seed, dropout_offset, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]), p)
        self.calls.append(("forward", record))
        out, lse = _fake_forward(q, k, v, softmax_scale, causal, *window_size, keep, p)
        return (out, lse) if return_lse else out

    def flash_attn_backward(self, dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                            window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=_NO_DROPOUT,
                            dropout_seed=_NO_DROPOUT, dropout_offset=_NO_DROPOUT, deterministic=False, impl="auto"):
        record = dict(dout_stride=tuple(dout.stride()), dout_ptr=dout.data_ptr(), causal=causal,
                      window_size=window_size, impl=impl, softcap=softcap, deterministic=deterministic)
        dropout, p = _fake_dropout(dropout_p, dropout_seed, dropout_offset)
        keep = None
        if dropout is not None:
            record["dropout"] = dropout
            keep = _fake_keep(dropout_seed, dropout_offset, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]), p)
        self.calls.append(("backward", record))
        return _fake_backward(dout, q, k, v, softmax_scale, causal, *window_size, keep, p)

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                               causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, dropout_p=_NO_DROPOUT, dropout_seed=_NO_DROPOUT,
                               dropout_offset=_NO_DROPOUT, return_lse=False, impl="auto", validate=True):
        import torch

        record = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, impl=impl,
                      return_lse=return_lse, validate=validate, max_seqlen=(max_seqlen_q, max_seqlen_k))
        assert type(max_seqlen_q) is int and type(max_seqlen_k) is int
        dropout, p = _fake_dropout(dropout_p, dropout_seed, dropout_offset)
        if dropout is not None:
            record["dropout"] = dropout
        self.calls.append(("varlen_forward", record))
        out = torch.zeros(q.shape, dtype=q.dtype)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
        for b, qs, qe, ks, ke in _sequences(cu_seqlens_q, cu_seqlens_k):
            assert qe - qs <= max_seqlen_q and ke - ks <= max_seqlen_k
            keep = None if dropout is None else _fake_keep(dropout_seed, dropout_offset,
                                                           (1, q.shape[1], qe - qs, ke - ks), p, b)
            o, l = _fake_forward(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], softmax_scale, causal,
                                 *window_size, keep, p)
            out[qs:qe], lse[:, qs:qe] = o[0], l[0]
        return (out, lse) if return_lse else out

    def flash_attn_varlen_backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                                   softcap=0.0, alibi_slopes=None, dropout_p=_NO_DROPOUT, dropout_seed=_NO_DROPOUT,
                                   dropout_offset=_NO_DROPOUT, deterministic=False, impl="auto", validate=True):
        import torch

        record = dict(dout_stride=tuple(dout.stride()), dout_ptr=dout.data_ptr(), causal=causal,
                      window_size=window_size, impl=impl, softcap=softcap, deterministic=deterministic,
                      validate=validate, max_seqlen=(max_seqlen_q, max_seqlen_k))
        assert type(max_seqlen_q) is int and type(max_seqlen_k) is int
        assert lse.shape == (q.shape[1], q.shape[0]) and out.shape == q.shape
        dropout, p = _fake_dropout(dropout_p, dropout_seed, dropout_offset)
        if dropout is not None:
            record["dropout"] = dropout
        self.calls.append(("varlen_backward", record))
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for b, qs, qe, ks, ke in _sequences(cu_seqlens_q, cu_seqlens_k):
            keep = None if dropout is None else _fake_keep(dropout_seed, dropout_offset,
                                                           (1, q.shape[1], qe - qs, ke - ks), p, b)
            g = _fake_backward(dout[None, qs:qe], q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], softmax_scale,
                               causal, *window_size, keep, p)
            dq[qs:qe], dk[ks:ke], dv[ks:ke] = g[0][0], g[1][0], g[2][0]
        return dq, dk, dv


@pytest.fixture
def cpu_attention(monkeypatch):
    """cuflash.torch with cuflash's four public functions replaced by the CPU references above."""
    _torch()
    import cuflash.torch as ct

    fake = _FakeApi()
    monkeypatch.setattr(ct._api, "flash_attn_func", fake.flash_attn_func)
    monkeypatch.setattr(ct._api, "flash_attn_backward", fake.flash_attn_backward)
    monkeypatch.setattr(ct._api, "flash_attn_varlen_func", fake.flash_attn_varlen_func)
    monkeypatch.setattr(ct._api, "flash_attn_varlen_backward", fake.flash_attn_varlen_backward)
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
    assert schema.endswith("float dropout_p=0., Tensor? dropout_seed=None, SymInt dropout_offset=0) -> (Tensor, Tensor)")
    schema = str(torch.ops.cuflash.flash_attn_bwd.default._schema)
    assert "Tensor? dropout_seed=None" in schema and schema.endswith("-> (Tensor, Tensor, Tensor)")
    schema = str(torch.ops.cuflash.flash_attn_varlen_fwd.default._schema)
    assert schema.startswith("cuflash::flash_attn_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
                             "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float? softmax_scale")
    assert "bool validate, float dropout_p=0., Tensor? dropout_seed=None" in schema
    assert schema.endswith("-> (Tensor, Tensor)")
    schema = str(torch.ops.cuflash.flash_attn_varlen_bwd.default._schema)
    assert schema.startswith("cuflash::flash_attn_varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
                             "Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q")
    assert schema.endswith("-> (Tensor, Tensor, Tensor)")


@pytest.mark.parametrize("value", ["0", "false", "OFF"])
def test_torch_env_switch_off_leaves_ops_unregistered(value):
    _torch()
    out = _run_python("""
        import torch, cuflash.torch as ct
        ops = ("flash_attn_fwd", "flash_attn_varlen_fwd", "flash_attn_varlen_bwd")
        print(ct.custom_op_enabled(), *(hasattr(torch.ops.cuflash, op) for op in ops))
        ct.use_custom_op(True)
        print(ct.custom_op_enabled(), *(hasattr(torch.ops.cuflash, op) for op in ops))
    """, {"CUFLASH_TORCH_CUSTOM_OP": value})
    assert out.splitlines() == ["False False False False", "True True True True"]


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
        out = ct.flash_attn_func(q, k, v, 0.0, 0.25, True, (3, 5), impl="fa2", deterministic=True)
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


def test_torch_backward_impl_falls_back_when_family_cannot_run_the_backward(monkeypatch):
    """The backward runs on the forward's family when that family's backward takes the call (head dim and
    features), else on "auto": a forward that ran never leaves a backward that cannot."""
    _torch()
    import cuflash.torch as ct

    class NoBackward:
        BWD_FEATURES = None
        HEADDIMS = (64,)

    class WithBackward:
        BWD_FEATURES = frozenset({"causal", "gqa"})
        HEADDIMS = (64, 128)
        BWD_HEADDIMS = (64,)

    monkeypatch.setattr(ct._api, "_FAMILIES", {"x": NoBackward, "y": WithBackward})
    plain = dict(causal=True, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
                 dropout_p=0.0)
    assert ct._backward_impl("x", 64, **plain) == "auto"
    assert ct._backward_impl("y", 64, **plain) == "y"
    assert ct._backward_impl("y", 128, **plain) == "auto"  # the forward's head dim, not the backward's
    assert ct._backward_impl("y", 64, **{**plain, "softcap": 30.0}) == "auto"
    assert ct._backward_impl("y", 64, **{**plain, "deterministic": True}) == "auto"
    assert ct._backward_impl("y", 64, **{**plain, "dropout_p": 0.1}) == "auto"
    assert ct._backward_impl("y", 64, **{**plain, "window_left": 8}) == "auto"
    assert ct._backward_impl("y", 64, **plain, varlen=True) == "auto"
    assert ct._backward_impl("auto", 64, **plain) == "auto"


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


# --- torch: flash_attn_varlen_func ----------------------------------------------------------------

def _varlen_inputs(torch, lens_q, lens_k, h=4, hk=2, d=8, extra_rows=3, dtype=None, requires_grad=True, seed=0):
    """Packed q/k/v with ``extra_rows`` unused rows at the end, and the int32 offsets."""
    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(itertools.accumulate(lens_k)), dtype=torch.int32)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype).requires_grad_(requires_grad)

    total_q, total_k = int(cu_q[-1]) + extra_rows, int(cu_k[-1]) + extra_rows
    return rand(total_q, h, d), rand(total_k, hk, d), rand(total_k, hk, d), cu_q, cu_k


def _varlen_sdpa_reference(torch, q, k, v, cu_q, cu_k, causal):
    """Per-sequence SDPA (fp32, bottom-right causal mask) over packed q/k/v; rows that see no key (and
    rows past the last sequence) are 0. Differentiable with respect to q, k and v."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    for _, qs, qe, ks, ke in _sequences(cu_q, cu_k):
        sq, sk = qe - qs, ke - ks
        first = (max(0, sq - sk) if causal else 0) if sk else sq  # rows before `first` see no key
        if first < sq:
            o = _sdpa_reference(torch, q[None, qs + first:qe], k[None, ks:ke], v[None, ks:ke], causal)
            out = out.index_put((torch.arange(qs + first, qe),), o[0].float())
    return out


VARLEN_LENS = [
    ([5, 0, 1, 9, 4], [9, 3, 1, 5, 4]),  # an empty query sequence, a length-1 one, Sq > Sk and Sq < Sk
    ([3, 2], [0, 6]),  # an empty key sequence: its rows see nothing
]


@pytest.mark.parametrize("custom_op", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", VARLEN_LENS)
def test_torch_varlen_autograd_plumbing(cpu_attention, custom_op, causal, lens):
    torch = _torch()
    ct = cpu_attention
    ct.use_custom_op(custom_op)
    q, k, v, cu_q, cu_k = _varlen_inputs(torch, *lens)
    out, lse = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens[0]), max(lens[1]), causal=causal,
                                         return_lse=True)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    assert out.requires_grad and not lse.requires_grad
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = _varlen_sdpa_reference(torch, q2, k2, v2, cu_q, cu_k, causal)
    rq, rk, rv = torch.autograd.grad(ref, (q2, k2, v2), dout)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in ((dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not out[int(cu_q[-1]):].any() and not dq[int(cu_q[-1]):].any() and not dk[int(cu_k[-1]):].any()
    assert bool((lse[:, int(cu_q[-1]):] == float("-inf")).all())


@pytest.mark.parametrize("custom_op", [True, False])
def test_torch_varlen_options_reach_cuflash(cpu_attention, monkeypatch, custom_op):
    torch = _torch()
    ct = cpu_attention
    ct.use_custom_op(custom_op)
    calls = ct.fake_api.calls

    class NoBackward:
        BWD_FEATURES = None

    monkeypatch.setattr(ct._api, "_FAMILIES", {"fa1": object(), "fa3": NoBackward})
    q, k, v, cu_q, cu_k = _varlen_inputs(torch, [4, 6], [4, 6])
    # flash-attn's positional order: ..., max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal
    out = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 7, 0.0, 0.25, True, (3, 5), impl="fa3",
                                    deterministic=True)
    out.sum().backward()
    fwd, bwd = calls[-2], calls[-1]
    assert fwd == ("varlen_forward", dict(causal=True, softmax_scale=0.25, window_size=(3, 5), softcap=0.0,
                                          impl="fa3", return_lse=True, validate=True, max_seqlen=(6, 7)))
    assert bwd[0] == "varlen_backward"
    bwd = bwd[1]
    assert bwd["causal"] is True and bwd["window_size"] == (3, 5) and bwd["impl"] == "auto"
    assert bwd["deterministic"] is True and bwd["softcap"] == 0.0 and bwd["max_seqlen"] == (6, 7)
    assert bwd["validate"] is False  # the forward checked the offsets
    assert bwd["dout_stride"] == (4 * 8, 8, 1)  # the broadcast gradient of out.sum(), made contiguous
    ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, np.int64(6), 6, softcap=30, impl="fa1", validate=False)
    assert calls[-1][1]["softcap"] == 30.0 and calls[-1][1]["impl"] == "fa1"
    assert calls[-1][1]["validate"] is False and calls[-1][1]["max_seqlen"] == (6, 6)
    # a dout layout the kernels read is passed as it is
    out = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6)
    good = torch.randn(out.shape[1], out.shape[0], out.shape[2]).transpose(0, 1)
    out.backward(good)
    assert calls[-1][1]["dout_stride"] == good.stride() and calls[-1][1]["dout_ptr"] == good.data_ptr()


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(max_seqlen_q="tensor"), TypeError, "max_seqlen_q must be a Python int"),
    (dict(max_seqlen_k=6.0), TypeError, "max_seqlen_k must be a Python int"),
    (dict(max_seqlen_k=True), TypeError, "max_seqlen_k must be a Python int"),
    (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be >= 0"),
    (dict(cu_seqlens_q=[0, 4, 10]), TypeError, "cu_seqlens_q must be a torch tensor"),
    (dict(validate=1), TypeError, "validate must be a bool"),
    (dict(causal=1), TypeError, "causal"),
    (dict(deterministic="yes"), TypeError, "deterministic"),
    (dict(window_size=(1, 2, 3)), TypeError, "window_size"),
    (dict(softmax_scale=True), TypeError, "bool"),
    (dict(dropout_p=True), TypeError, "dropout_p"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p"),
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p"),
])
def test_torch_varlen_argument_checks(cpu_attention, kwargs, exc, match):
    torch = _torch()
    ct = cpu_attention
    q, k, v, cu_q, cu_k = _varlen_inputs(torch, [4, 6], [4, 6], requires_grad=False)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6, max_seqlen_k=6)
    args.update(kwargs)
    if args["max_seqlen_q"] == "tensor":
        args["max_seqlen_q"] = torch.tensor(6)
    state = torch.get_rng_state()
    with pytest.raises(exc, match=match):
        ct.flash_attn_varlen_func(**args)
    assert torch.equal(torch.get_rng_state(), state)  # refused before any seed is drawn
    assert not ct.fake_api.calls


@pytest.mark.parametrize("dropout_p, exc", [(True, TypeError), (None, TypeError), (1.0, ValueError),
                                            (1.5, ValueError), (-1e-3, ValueError)])
def test_torch_dropout_p_checks(dropout_p, exc):
    torch = _torch()
    import cuflash.torch as ct

    q, k, v = _qkv(torch, requires_grad=False)
    with pytest.raises(exc, match="dropout_p"):
        ct.flash_attn_func(q, k, v, dropout_p=dropout_p)


def test_torch_varlen_fake_implementations_shapes():
    torch = _torch()
    from torch._subclasses.fake_tensor import FakeTensorMode

    import cuflash.torch as ct

    ct.use_custom_op(True)
    fwd, bwd = torch.ops.cuflash.flash_attn_varlen_fwd.default, torch.ops.cuflash.flash_attn_varlen_bwd.default
    with FakeTensorMode():
        q = torch.empty(8, 100, 64, dtype=torch.bfloat16).transpose(0, 1)  # non-contiguous (heads-major)
        k = torch.empty(120, 2, 64, dtype=torch.bfloat16)
        v = torch.empty(120, 2, 64, dtype=torch.bfloat16)
        cu_q = torch.empty(4, dtype=torch.int32)
        cu_k = torch.empty(4, dtype=torch.int32)
        seed = torch.empty((), dtype=torch.int64)
        out, lse = fwd(q, k, v, cu_q, cu_k, 50, 60, None, True, -1, -1, 0.0, None, "auto", False, True, 0.1, seed, 0)
        assert out.shape == (100, 8, 64) and out.dtype == torch.bfloat16 and out.is_contiguous()
        assert lse.shape == (8, 100) and lse.dtype == torch.float32 and lse.is_contiguous()
        out2, _ = fwd(q, k, v, cu_q, cu_k, 50, 60, 0.5, False, 3, 0, 0.0, None, "fa2", False, False)  # no dropout
        assert out2.shape == (100, 8, 64)
        dq, dk, dv = bwd(out, q, k, v, out, lse, cu_q, cu_k, 50, 60, 0.125, False, 16, 0, 0.0, None, "fa2", True,
                         False, 0.1, seed, 0)
        assert dq.shape == q.shape and dq.dtype == q.dtype and dq.is_contiguous()
        assert dk.shape == dv.shape == k.shape and dk.dtype == dv.dtype == torch.bfloat16
        assert dk.is_contiguous() and dv.is_contiguous()


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_torch_varlen_fake_tensor_mode_through_public_function(dropout_p):
    torch = _torch()
    from torch._subclasses.fake_tensor import FakeTensorMode

    import cuflash.torch as ct

    ct.use_custom_op(True)
    with FakeTensorMode():
        q = torch.empty(30, 6, 32, dtype=torch.float16, requires_grad=True)
        k = v = torch.empty(20, 3, 32, dtype=torch.float16)
        cu = torch.empty(3, dtype=torch.int32)
        out, lse = ct.flash_attn_varlen_func(q, k, v, cu, cu, 15, 10, dropout_p=dropout_p, causal=True,
                                             return_lse=True)
        assert out.shape == q.shape and lse.shape == (6, 30)
        (dq,) = torch.autograd.grad(out.sum(), (q,))
        assert dq.shape == q.shape


def test_torch_varlen_opcheck_with_cpu_reference(cpu_attention):
    torch = _torch()
    q, k, v, cu_q, cu_k = _varlen_inputs(torch, [5, 0, 7], [6, 2, 3])
    fwd, bwd = torch.ops.cuflash.flash_attn_varlen_fwd.default, torch.ops.cuflash.flash_attn_varlen_bwd.default
    seed = torch.tensor(12345, dtype=torch.int64)
    torch.library.opcheck(fwd, (q, k, v, cu_q, cu_k, 7, 6, None, True, -1, -1, 0.0, None, "auto", False, True))
    torch.library.opcheck(fwd, (q, k, v, cu_q, cu_k, 7, 6, 0.3, False, 3, 1, 0.0, None, "auto", True, False))
    torch.library.opcheck(fwd, (q, k, v, cu_q, cu_k, 7, 6, None, True, -1, -1, 0.0, None, "auto", False, True,
                                0.25, seed, 3))
    with torch.no_grad():
        out, lse = fwd(q, k, v, cu_q, cu_k, 7, 6, None, True, -1, -1, 0.0, None, "auto", False, True)
    dout = torch.randn_like(out)
    qd, kd, vd = (x.detach() for x in (q, k, v))
    torch.library.opcheck(bwd, (dout, qd, kd, vd, out, lse, cu_q, cu_k, 7, 6, None, True, -1, -1, 0.0, None, "auto",
                                False, False))
    torch.library.opcheck(bwd, (dout, qd, kd, vd, out, lse, cu_q, cu_k, 7, 6, None, True, -1, -1, 0.0, None, "auto",
                                False, False, 0.25, seed, 3))


def test_torch_varlen_compile_fullgraph_with_cpu_reference(cpu_attention):
    torch = _torch()
    ct = cpu_attention
    lens = [3, 0, 5]

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 32)

        def forward(self, q, k, v, cu):
            o = ct.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
            return self.proj(o.flatten(1))

    torch.manual_seed(0)
    model = Block()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    q, k, v, cu, _ = _varlen_inputs(torch, lens, lens, h=4, hk=2, d=8)
    y = compiled(q, k, v, cu)
    y.square().sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    y2 = model(q2, k2, v2, cu)
    y2.square().sum().backward()
    torch.testing.assert_close(y, y2)
    for got, x in zip(grads, (q2, k2, v2)):
        torch.testing.assert_close(got, x.grad)


def test_torch_varlen_cpu_tensors_are_refused_by_cuflash():
    torch = _torch()
    pytest.importorskip("cupy")
    import cuflash.torch as ct

    q, k, v, cu_q, cu_k = _varlen_inputs(torch, [4, 6], [4, 6], dtype=torch.float16, requires_grad=False)
    for custom_op in (True, False):
        previous = ct.use_custom_op(custom_op)
        try:
            with pytest.raises(TypeError, match="CUDA device memory"):
                ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6)
        finally:
            ct.use_custom_op(previous)


def test_torch_kernel_readable_packed():
    torch = _torch()
    import cuflash.torch as ct

    base = torch.randn(37, 4, 64)
    assert ct._kernel_readable(base) is base
    heads_major = torch.randn(4, 37, 64).transpose(0, 1)
    assert ct._kernel_readable(heads_major) is heads_major
    odd = torch.randn(37, 4, 67)[..., :64]  # head stride 67
    fixed = ct._kernel_readable(odd)
    assert fixed is not odd and fixed.is_contiguous() and torch.equal(fixed, odd)
    bcast = torch.ones(()).expand(37, 4, 64)  # out.sum()'s gradient: all strides 0 -> last dim not contiguous
    assert ct._kernel_readable(bcast).is_contiguous()


# --- torch: dropout ---------------------------------------------------------------------------------

def _predicted_seed(torch, manual_seed):
    """The seed cuflash.torch draws first after ``torch.manual_seed(manual_seed)``."""
    torch.manual_seed(manual_seed)
    return int(torch.randint(0, 2 ** 63 - 1, (), dtype=torch.int64))


def _run_dropout(torch, ct, varlen, manual_seed, dropout_p=0.3, causal=False, deterministic=False, dout=None):
    """(out, grads, calls of this run) for one dropout call after torch.manual_seed(manual_seed)."""
    calls = ct.fake_api.calls
    start = len(calls)
    if varlen:
        q, k, v, cu_q, cu_k = _varlen_inputs(torch, [5, 0, 9], [7, 2, 4])
        torch.manual_seed(manual_seed)
        out = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 7, dropout_p, causal=causal,
                                        deterministic=deterministic)
    else:
        q, k, v = _qkv(torch, sq=6, sk=9)
        torch.manual_seed(manual_seed)
        out = ct.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic, dropout_p=dropout_p)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)) if dout is None else dout
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out, grads, calls[start:], (q, k, v)


@pytest.mark.parametrize("custom_op", [True, False])
@pytest.mark.parametrize("varlen", [False, True])
def test_torch_dropout_seed_reaches_forward_and_backward(cpu_attention, custom_op, varlen):
    torch = _torch()
    ct = cpu_attention
    ct.use_custom_op(custom_op)
    out, grads, calls, _ = _run_dropout(torch, ct, varlen, 1234)
    (fwd_kind, fwd), (bwd_kind, bwd) = calls
    assert fwd_kind.endswith("forward") and bwd_kind.endswith("backward")
    seed = _predicted_seed(torch, 1234)
    assert fwd["dropout"] == (0.3, seed, 0) == bwd["dropout"]  # the backward regenerates the same mask

    # same torch seed: the same mask, outputs and gradients; another seed: another mask
    out2, grads2, calls2, _ = _run_dropout(torch, ct, varlen, 1234)
    assert calls2[0][1]["dropout"] == (0.3, seed, 0)
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    out3, grads3, calls3, _ = _run_dropout(torch, ct, varlen, 4321)
    assert calls3[0][1]["dropout"][1] == _predicted_seed(torch, 4321) != seed
    assert not torch.equal(out, out3)
    # consecutive calls draw fresh seeds
    torch.manual_seed(7)
    q, k, v = _qkv(torch, requires_grad=False)
    ct.flash_attn_func(q, k, v, dropout_p=0.1)
    ct.flash_attn_func(q, k, v, dropout_p=0.1)
    assert ct.fake_api.calls[-1][1]["dropout"][1] != ct.fake_api.calls[-2][1]["dropout"][1]


@pytest.mark.parametrize("custom_op", [True, False])
@pytest.mark.parametrize("varlen", [False, True])
def test_torch_dropout_zero_changes_nothing(cpu_attention, custom_op, varlen):
    torch = _torch()
    ct = cpu_attention
    ct.use_custom_op(custom_op)
    state = torch.get_rng_state()
    calls = ct.fake_api.calls
    if varlen:
        q, k, v, cu_q, cu_k = _varlen_inputs(torch, [4, 6], [4, 6])
        out = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, 0.0)
    else:
        q, k, v = _qkv(torch)
        out = ct.flash_attn_func(q, k, v, dropout_p=0)
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), state)  # no seed drawn
    assert len(calls) == 2 and all("dropout" not in record for _, record in calls)  # no dropout keywords


@pytest.mark.parametrize("custom_op", [True, False])
@pytest.mark.parametrize("varlen", [False, True])
def test_torch_dropout_gradients_use_the_forward_mask(cpu_attention, custom_op, varlen):
    """The fakes drop with a mask that is a function of the seed: autograd's gradients match the
    reference with that mask only if the backward got the forward's seed and offset."""
    torch = _torch()
    ct = cpu_attention
    ct.use_custom_op(custom_op)
    p = 0.3
    out, grads, calls, (q, k, v) = _run_dropout(torch, ct, varlen, 99, dropout_p=p, causal=True)
    _, seed, offset = calls[0][1]["dropout"]
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    if varlen:
        cu_q, cu_k = torch.tensor([0, 5, 5, 14], dtype=torch.int32), torch.tensor([0, 7, 9, 13], dtype=torch.int32)
        ref = torch.zeros(q.shape)
        for b, qs, qe, ks, ke in _sequences(cu_q, cu_k):
            keep = _fake_keep(seed, offset, (1, q.shape[1], qe - qs, ke - ks), p, b)
            o, _, _ = _ref_forward_torch(q2[None, qs:qe], k2[None, ks:ke], v2[None, ks:ke], None, True, -1, -1,
                                         keep, p)
            ref = ref.index_put((torch.arange(qs, qe),), o[0])
    else:
        keep = _fake_keep(seed, offset, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]), p)
        ref, _, _ = _ref_forward_torch(q2, k2, v2, None, True, -1, -1, keep, p)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    want = torch.autograd.grad(ref, (q2, k2, v2), dout)
    for got, w in zip(grads, want):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("varlen", [False, True])
def test_torch_dropout_compile_fullgraph(cpu_attention, varlen):
    """The seed draw traces into the graph (no graph break); forward and backward get the same seed,
    and torch.manual_seed reproduces the compiled run."""
    torch = _torch()
    ct = cpu_attention
    calls = ct.fake_api.calls

    def f(q, k, v, cu):
        if varlen:
            return ct.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, 0.2, causal=True)
        return ct.flash_attn_func(q, k, v, causal=True, dropout_p=0.2)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    if varlen:
        q, k, v, cu, _ = _varlen_inputs(torch, [4, 6], [4, 6])
    else:
        q, k, v = _qkv(torch, sq=6, sk=6)
        cu = None
    runs = []
    for manual_seed in (5, 5, 6):
        start = len(calls)
        torch.manual_seed(manual_seed)
        out = compiled(q, k, v, cu)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        fwd, bwd = calls[start][1], calls[-1][1]
        assert fwd["dropout"] == bwd["dropout"]
        runs.append((fwd["dropout"][1], out, grads))
    assert runs[0][0] == runs[1][0] != runs[2][0]
    assert torch.equal(runs[0][1], runs[1][1]) and all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2]))


def test_torch_backward_dropout_refused_when_backward_lacks_it(monkeypatch):
    torch = _torch()
    import cuflash.torch as ct

    def old_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                     impl="auto"):
        raise AssertionError("not called")

    assert ct._backward_dropout(old_backward, 0.0, None, 0) == {}
    with pytest.raises(ValueError, match="dropout"):
        ct._backward_dropout(old_backward, 0.1, torch.tensor(3), 0)
    assert ct._backward_dropout(ct._api.flash_attn_backward, 0.1, torch.tensor(3), 2) == dict(
        dropout_p=0.1, dropout_seed=3, dropout_offset=2)
    assert ct._backward_dropout(ct._api.flash_attn_varlen_backward, 0.1, torch.tensor(2 ** 62), 0) == dict(
        dropout_p=0.1, dropout_seed=2 ** 62, dropout_offset=0)


def test_torch_drawn_seed_is_a_cpu_int64_scalar():
    torch = _torch()
    import cuflash.torch as ct

    torch.manual_seed(0)
    seeds = {int(ct._draw_dropout_seed()) for _ in range(20)}
    assert len(seeds) == 20 and all(0 <= s < 2 ** 63 - 1 for s in seeds)
    t = ct._draw_dropout_seed()
    assert t.device.type == "cpu" and t.dtype == torch.int64 and t.dim() == 0


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
    assert cj._backward_kwargs(opts, 64) == dict(causal=True, softmax_scale=0.5, window_size=(3, 0), impl="auto")
    assert cj._backward_kwargs(opts._replace(deterministic=True), 64)["deterministic"] is True
    # The forward's family where its backward runs the call: FA3's has no deterministic mode and no d = 96.
    assert cj._backward_kwargs(opts._replace(impl="fa3"), 64)["impl"] == "fa3"
    assert cj._backward_kwargs(opts._replace(impl="fa3", deterministic=True), 64)["impl"] == "auto"
    assert cj._backward_kwargs(opts._replace(impl="fa3"), 96)["impl"] == "auto"


def test_jax_fold_helpers():
    _jax()
    import cuflash.jax as cj

    a = np.zeros((3, 2, 5, 4, 8))
    assert cj._fold_bshd(a).shape == (6, 5, 4, 8)
    assert cj._fold_bshd(a[0]).shape == (2, 5, 4, 8)
    assert cj._fold_bhs(np.zeros((3, 2, 4, 5))).shape == (6, 4, 5)
    assert cj._fold_bhs(np.zeros((2, 4, 5))).shape == (2, 4, 5)


def test_plain_api_reads_tensors_that_require_grad():
    """torch refuses to export a tensor that requires grad; the plain API reads its data detached."""
    torch = pytest.importorskip("torch")
    from cuflash._interop import _exportable

    t = torch.ones(3, requires_grad=True)
    with pytest.raises(BufferError):
        t.__dlpack__()
    view = _exportable(t)
    assert not view.requires_grad and view.data_ptr() == t.data_ptr()
    view.__dlpack__()
    plain = torch.ones(3)
    assert _exportable(plain) is plain


def test_available_impls_direction(monkeypatch):
    import cuflash
    from cuflash import _device

    with pytest.raises(ValueError, match="direction"):
        cuflash.available_impls("sideways")
    monkeypatch.setattr(_device, "has_gpu", lambda: True)
    monkeypatch.setattr(_device, "compute_capability", lambda device=None: (9, 0))
    assert cuflash.available_impls() == ["fa1", "fa2", "fa3"]
    assert cuflash.available_impls("forward") == ["fa1", "fa2", "fa3"]
    assert cuflash.available_impls("backward") == ["fa1", "fa2", "fa3"]
    monkeypatch.setattr(_device, "compute_capability", lambda device=None: (8, 0))
    assert cuflash.available_impls("forward") == ["fa1", "fa2"]


# ----------------------------------------------------------------------------------------------------
# cuflash.torch.flash_attn_with_kvcache (inference: the plumbing; the GPU tier checks the numbers)
# ----------------------------------------------------------------------------------------------------

@pytest.fixture
def kvcache_calls(monkeypatch):
    """cuflash.torch with cuflash.flash_attn_with_kvcache replaced by a recorder returning zeros."""
    torch = _torch()
    import cuflash.torch as ct

    calls = []

    def fake(q, k_cache, v_cache, k=None, v=None, **kw):
        calls.append(dict(kw, k=k, v=v))
        b, s, h, _ = q.shape
        return torch.zeros_like(q), torch.zeros(b, h, s, dtype=torch.float32)

    monkeypatch.setattr(ct._api, "flash_attn_with_kvcache", fake)
    previous = ct.use_custom_op(True)
    yield ct, calls
    ct.use_custom_op(previous)


@pytest.mark.parametrize("custom_op", [True, False])
@pytest.mark.parametrize("seqlens", ["tensor", "int"])
def test_torch_kvcache_plumbing(kvcache_calls, custom_op, seqlens):
    torch = _torch()
    ct, calls = kvcache_calls
    ct.use_custom_op(custom_op)
    q = torch.randn(2, 1, 8, 16)
    k_cache = v_cache = torch.zeros(2, 32, 2, 16)
    cache_seqlens = torch.tensor([3, 5], dtype=torch.int32) if seqlens == "tensor" else 4
    out, lse = ct.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, causal=True,
                                          window_size=(7, 0), softcap=2.0, num_splits=3, return_softmax_lse=True,
                                          check=False)
    assert out.shape == q.shape and lse.shape == (2, 8, 1)
    call = calls[-1]
    assert call["causal"] is True and call["window_size"] == (7, 0) and call["softcap"] == 2.0
    assert call["num_splits"] == 3 and call["check"] is False and call["return_softmax_lse"] is True
    if seqlens == "tensor":
        assert torch.equal(call["cache_seqlens"], cache_seqlens)
    else:
        assert call["cache_seqlens"] == 4
    assert ct.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens).shape == q.shape


def test_torch_kvcache_refuses_what_it_lacks(kvcache_calls):
    torch = _torch()
    ct, _ = kvcache_calls
    q = torch.randn(1, 1, 2, 16)
    cache = torch.zeros(1, 8, 2, 16)
    with pytest.raises(ValueError, match="cache_leftpad"):
        ct.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=1, cache_leftpad=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="alibi_slopes"):
        ct.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=1, alibi_slopes=torch.ones(2))
    with pytest.raises(TypeError, match="cache_seqlens is required"):
        ct.flash_attn_with_kvcache(q, cache, cache)
    with pytest.raises(TypeError, match="cache_seqlens must be"):
        ct.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=1.5)
    with pytest.raises(TypeError, match="num_splits"):
        ct.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=1, num_splits=True)


def test_torch_kvcache_fake_implementation():
    torch = _torch()
    from torch._subclasses.fake_tensor import FakeTensorMode

    import cuflash.torch as ct

    ct.use_custom_op(True)
    op = torch.ops.cuflash.flash_attn_with_kvcache.default
    with FakeTensorMode():
        q = torch.empty(3, 2, 8, 64, dtype=torch.bfloat16)
        cache = torch.empty(3, 128, 2, 64, dtype=torch.bfloat16)
        out, lse = op(q, cache, cache, None, None, None, 5, None, None, None, None, False, None, True, -1, -1, 0.0, 0,
                      False)
        assert out.shape == q.shape and out.dtype == torch.bfloat16
        assert lse.shape == (3, 8, 2) and lse.dtype == torch.float32
