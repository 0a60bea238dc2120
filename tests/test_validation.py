"""CPU tier: bad input is refused with a ValueError/TypeError naming the argument and what was
expected, before any kernel runs. Checks run on Spec records, so no device memory is needed."""
import numpy as np
import pytest

import cuflash
from cuflash import _validate
from cuflash._interop import Spec


def spec(name, shape, dtype="bfloat16", strides=None, device=0, ptr=0x10000):
    if strides is None:
        strides, acc = [], 1
        for s in reversed(shape):
            strides.append(acc)
            acc *= s
        strides = tuple(reversed(strides))
    return Spec(name, tuple(shape), tuple(strides), dtype, device, ptr)


def qkv(b=2, sq=64, sk=80, h=8, hkv=2, d=64, **over):
    q = spec("q", (b, sq, h, d))
    k = spec("k", (b, sk, hkv, d))
    v = spec("v", (b, sk, hkv, d))
    parts = {"q": q, "k": k, "v": v}
    parts.update(over)
    return parts["q"], parts["k"], parts["v"]


def test_good_input_gives_dims():
    dims = _validate.check_qkv(*qkv())
    assert (dims.batch, dims.seqlen_q, dims.seqlen_k, dims.heads, dims.kv_heads, dims.headdim) == (2, 64, 80, 8, 2, 64)


BAD = [
    # (what, overrides, exception, words the message must contain)
    ("rank 3 q", {"q": spec("q", (2, 64, 64))}, ValueError, ["q", "4 dimensions"]),
    ("rank 5 k", {"k": spec("k", (2, 80, 2, 64, 1))}, ValueError, ["k", "4 dimensions"]),
    ("float32 q", {"q": spec("q", (2, 64, 8, 64), "float32")}, TypeError, ["q", "float16 or bfloat16", "float32"]),
    ("int8 v", {"v": spec("v", (2, 80, 2, 64), "int8")}, TypeError, ["v", "float16 or bfloat16"]),
    ("mixed dtypes", {"k": spec("k", (2, 80, 2, 64), "float16")}, TypeError, ["k", "dtype of q"]),
    ("batch mismatch", {"k": spec("k", (3, 80, 2, 64)), "v": spec("v", (3, 80, 2, 64))}, ValueError,
     ["batch", "k"]),
    ("headdim mismatch", {"k": spec("k", (2, 80, 2, 128)), "v": spec("v", (2, 80, 2, 128))}, ValueError,
     ["head dim"]),
    ("k/v shapes differ", {"v": spec("v", (2, 81, 2, 64))}, ValueError, ["k and v", "same shape"]),
    ("heads not divisible", {"k": spec("k", (2, 80, 3, 64)), "v": spec("v", (2, 80, 3, 64))}, ValueError,
     ["query heads (8)", "KV heads", "(3)"]),
    ("empty q", {"q": spec("q", (2, 0, 8, 64))}, ValueError, ["seqlen_q", "at least 1"]),
    ("empty k", {"k": spec("k", (2, 0, 2, 64)), "v": spec("v", (2, 0, 2, 64))}, ValueError, ["seqlen_k"]),
    ("non-contiguous last dim", {"q": spec("q", (2, 64, 8, 64), strides=(2 * 64 * 8 * 64, 8 * 64 * 2, 64 * 2, 2))},
     ValueError, ["q", "last dimension", "contiguous"]),
    ("unaligned row stride", {"k": spec("k", (2, 80, 2, 64), strides=(80 * 132, 132, 66, 1))}, ValueError,
     ["k", "stride", "16 bytes"]),
    ("unaligned pointer", {"v": spec("v", (2, 80, 2, 64), ptr=0x10002)}, ValueError, ["v", "16-byte aligned"]),
    ("devices differ", {"k": spec("k", (2, 80, 2, 64), device=1)}, ValueError, ["k", "device 1", "device 0"]),
]


@pytest.mark.parametrize("what,over,exc,words", BAD, ids=[b[0] for b in BAD])
def test_bad_qkv(what, over, exc, words):
    with pytest.raises(exc) as info:
        _validate.check_qkv(*qkv(**over))
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_backward_arguments():
    q, k, v = qkv()
    dims = _validate.check_qkv(q, k, v)
    with pytest.raises(ValueError, match="dout must have the shape of q"):
        _validate.check_like(spec("dout", (2, 63, 8, 64)), q)
    with pytest.raises(TypeError, match="out must have the dtype of q"):
        _validate.check_like(spec("out", (2, 64, 8, 64), "float16"), q)
    with pytest.raises(ValueError, match=r"lse must have shape \(batch, heads, seqlen_q\) = \(2, 8, 64\)"):
        _validate.check_lse(spec("lse", (2, 64, 8), "float32"), dims, q)
    with pytest.raises(TypeError, match="lse must be float32"):
        _validate.check_lse(spec("lse", (2, 8, 64), "bfloat16"), dims, q)
    _validate.check_lse(spec("lse", (2, 8, 64), "float32"), dims, q)


def test_scale_window_headdim():
    dims = _validate.check_qkv(*qkv())
    assert _validate.softmax_scale_or_default(None, 64) == pytest.approx(0.125)
    for bad, exc in ((0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), ("0.1", TypeError),
                     (True, TypeError)):
        with pytest.raises(exc, match="softmax_scale"):
            _validate.softmax_scale_or_default(bad, 64)
    assert _validate.window_bounds((-1, -1), False, dims) == (dims.seqlen_k, dims.seqlen_q)
    assert _validate.window_bounds((-1, -1), True, dims) == (dims.seqlen_k, 0)
    assert _validate.window_bounds((10 ** 9, 10 ** 9), False, dims) == (dims.seqlen_k, dims.seqlen_q)
    assert _validate.window_bounds((16, 3), False, dims) == (16, 3)
    for bad, exc in (((-2, 0), ValueError), ((1,), TypeError), ((1.5, 2), TypeError), ("ab", TypeError)):
        with pytest.raises(exc, match="window_size"):
            _validate.window_bounds(bad, False, dims)
    with pytest.raises(TypeError, match="causal"):
        _validate.window_bounds((-1, -1), 1, dims)
    with pytest.raises(ValueError, match=r"head dim 80 is not supported by impl='fa1'"):
        _validate.check_headdim(80, cuflash.fa1.HEADDIMS, "fa1")


def test_host_arrays_are_refused_before_anything_runs():
    q = np.zeros((1, 8, 2, 64), dtype=np.float16)
    with pytest.raises(TypeError, match="q must live in CUDA device memory"):
        cuflash.flash_attn_func(q, q, q)
    with pytest.raises(TypeError, match="must live in CUDA device memory"):
        cuflash.flash_attn_backward(q, q, q, q, q, np.zeros((1, 2, 8), np.float32))


class _HostDLPack:
    """Something with __dlpack__ that lives in host memory (a CPU torch tensor behaves like this)."""

    def __dlpack__(self, stream=None):
        raise AssertionError("must not be converted")

    def __dlpack_device__(self):
        return (1, 0)


def test_host_dlpack_objects_are_refused():
    with pytest.raises(TypeError, match=r"k must live in CUDA device memory"):
        from cuflash._interop import _refuse_host_memory

        _refuse_host_memory("k", _HostDLPack())


def test_unknown_impl_is_refused():
    from cuflash import api

    with pytest.raises(ValueError, match="impl must be one of"):
        api._pick_impl("fa9", 64, 0)


def test_launch_limits():
    with pytest.raises(ValueError, match="batch must be at most 65535"):
        _validate.check_qkv(*qkv(b=70000))
    with pytest.raises(ValueError, match="heads must be at most 65535"):
        _validate.check_qkv(*qkv(h=70000, hkv=1))
    with pytest.raises(ValueError, match="seqlen_k must be below 2\\*\\*30"):
        _validate.check_qkv(*qkv(sk=2 ** 30))


def test_fa3_packs_gqa_only_where_it_saves_tiles():
    from cuflash import fa3
    from cuflash._validate import Dims

    def pack(sq, h, hkv, varlen=False):
        return fa3.pack_gqa(Dims(2, sq, 512, h, hkv, 128, "bfloat16"), varlen)

    assert pack(1, 32, 8) and pack(16, 16, 2) and pack(30, 8, 2)  # e.g. 1 tile instead of 4 (g = 4)
    assert not pack(100, 8, 2)  # 4 tiles either way: packing saves nothing
    assert not pack(128, 32, 8)  # full tiles per head already
    assert not pack(1, 8, 8)  # no group
    assert not pack(1, 24, 8)  # group 3
    assert not pack(1, 32, 8, varlen=True)  # packed batches are not packed twice
    assert not pack(1, 256, 1)  # group 256 does not divide a warpgroup's 64 rows
