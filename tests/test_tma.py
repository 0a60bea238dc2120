"""Tensor-map encoding (CPU tier): argument checks and the cache that keeps cuTensorMapEncodeTiled out
of repeated calls. The driver call itself is replaced by a counting stand-in (no GPU here)."""
import types

import numpy as np
import pytest

from cuflash import _tma

driver = pytest.importorskip("cuda.bindings.driver")


@pytest.fixture
def fake_encode(monkeypatch):
    calls = []

    def encode(dtype, rank, ptr, shape, strides, box, elem_strides, interleave, swizzle, l2, oob):
        calls.append((ptr, tuple(int(s) for s in shape)))
        return driver.CUresult.CUDA_SUCCESS, types.SimpleNamespace(opaque=list(range(16)))

    monkeypatch.setattr(driver, "cuTensorMapEncodeTiled", encode)
    _tma._encode_tiled_cached.cache_clear()
    yield calls
    _tma._encode_tiled_cached.cache_clear()


def test_map_is_a_128_byte_kernel_argument(fake_encode):
    m = _tma.encode_tiled(0x1000, "bfloat16", (64, 128, 4, 2), (256, 128 * 256, 4 * 128 * 256), (64, 64, 1, 1))
    assert m.dtype.itemsize == 128 and m.shape == (1,)
    assert list(m["opaque"][0]) == list(range(16))


def test_repeated_calls_encode_once(fake_encode):
    args = ("bfloat16", (64, 128, 4, 2), (256, 32768, 131072), (64, 64, 1, 1))
    a = _tma.encode_tiled(0x1000, *args)
    b = _tma.encode_tiled(0x1000, *args)
    c = _tma.encode_tiled(0x2000, *args)  # another buffer: a map of its own
    assert len(fake_encode) == 2 and a is b and c is not a
    _tma.encode_tiled(np.int64(0x1000), "bfloat16", [64, 128, 4, 2], [256, 32768, 131072], [64, 64, 1, 1])
    assert len(fake_encode) == 2  # numpy ints and lists hit the same entry


@pytest.mark.parametrize("ptr, strides", [(0x1008, (256,)), (0x1000, (136,))])
def test_misaligned_base_or_stride_is_refused(fake_encode, ptr, strides):
    with pytest.raises(ValueError, match="16-byte aligned"):
        _tma.encode_tiled(ptr, "bfloat16", (64, 128), strides, (64, 64))
    assert not fake_encode


def test_driver_error_is_reported(monkeypatch):
    monkeypatch.setattr(driver, "cuTensorMapEncodeTiled",
                        lambda *a: (driver.CUresult.CUDA_ERROR_INVALID_VALUE, None))
    _tma._encode_tiled_cached.cache_clear()
    with pytest.raises(RuntimeError, match="cuTensorMapEncodeTiled failed"):
        _tma.encode_tiled(0x1000, "bfloat16", (64, 128), (256,), (64, 64))
