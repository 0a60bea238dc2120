"""CPU tier: cuflash.decode_plan -- which struct fields a run relocates, what run() hands the driver (a fake
libcuda), and every refusal: arrays of another layout, alignment, kind, a missing or extra array, out = q,
and plan_kvcache's own argument checks. The GPU tier (test_decode_gpu.py) compares runs with
flash_attn_with_kvcache."""
import contextlib
import ctypes
import types

import numpy as np
import pytest

import cuflash
from cuflash import _jit, decode, decode_plan
from cuflash.decode_plan import DecodePlan, _Launch, relocations


class FakeCupyArray:
    """What decode_plan reads of a CuPy array: shape, strides (bytes), dtype, device, data pointer."""

    __module__ = "cupy.fake"

    def __init__(self, shape, dtype, ptr, device=0):
        a = np.empty(shape, dtype)
        self.shape, self.strides, self.dtype = a.shape, a.strides, a.dtype
        self.data = types.SimpleNamespace(ptr=ptr)
        self.device = types.SimpleNamespace(id=device)


class FakeDriver:
    """cuLaunchKernelEx recorder: the config and the parameter struct's bytes as they were at the call."""

    def __init__(self):
        self.calls = []

    def cuLaunchKernelEx(self, config_ref, fn, params, extra):
        cfg = config_ref._obj
        size = self.sizes[fn]
        raw = ctypes.string_at(params[0], size)
        self.calls.append({"fn": fn, "stream": cfg.hStream, "grid": (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ),
                           "pdl": cfg.numAttrs, "params": raw})
        return 0


def arrays(shift=0):
    return {"q": FakeCupyArray((2, 1, 8, 128), np.float16, 0x10000 + shift),
            "k_cache": FakeCupyArray((2, 512, 2, 128), np.float16, 0x200000 + shift),
            "v_cache": FakeCupyArray((2, 512, 2, 128), np.float16, 0x400000 + shift),
            "cache_seqlens": FakeCupyArray((2,), np.int32, 0x600000 + shift),
            "out": FakeCupyArray((2, 1, 8, 128), np.float16, 0x700000 + shift)}


SCRATCH = 0x900000  # the plan's own workspace: not relocated


@pytest.fixture
def plan(monkeypatch):
    """A plan of a split decode call (split kernel + dependent combine) recorded from arrays(), run against
    a fake driver with the stream handle 0x5EA."""
    import cupy

    driver = FakeDriver()
    monkeypatch.setattr(_jit, "_libcuda", lambda: driver)
    monkeypatch.setattr(cupy.cuda, "Device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(DecodePlan, "_stream_handle", lambda self, q: 0x5EA)
    a = arrays()
    addresses = {n: x.data.ptr for n, x in a.items()}
    fwd = np.zeros(1, decode.FWD_PARAMS)
    for field, name in (("q", "q"), ("k", "k_cache"), ("v", "v_cache"), ("o", "out"), ("cache_seqlens", "cache_seqlens")):
        fwd[field] = addresses[name]
    fwd["o_partial"], fwd["lse_partial"], fwd["lse"], fwd["batch"] = SCRATCH, SCRATCH + 0x1000, SCRATCH + 0x2000, 2
    comb = np.zeros(1, decode.COMBINE_PARAMS)
    comb["o_partial"], comb["lse_partial"], comb["lse"], comb["o"], comb["num_splits"] = (
        SCRATCH, SCRATCH + 0x1000, SCRATCH + 0x2000, addresses["out"], 4)
    launches = [_Launch(decode.fwd_variant(128, "float16", False), (4, 2, 2), fwd, False, relocations(fwd, addresses), 0xF1),
                _Launch(decode.combine_variant("float16"), (4,), comb, True, relocations(comb, addresses), 0xF2)]
    driver.sizes = {0xF1: decode.FWD_PARAMS.itemsize, 0xF2: decode.COMBINE_PARAMS.itemsize}
    layouts = {n: decode_plan._layout_of(x, True)[1] for n, x in a.items()}
    p = DecodePlan("cupy", True, 0, layouts, {n: x.data.ptr % 16 for n, x in a.items()}, launches, None, [])
    return types.SimpleNamespace(plan=p, driver=driver, fwd=fwd, comb=comb)


def run(plan, **changes):
    a = arrays(0x100000)
    a.update(changes)
    return plan.run(a["q"], a["k_cache"], a["v_cache"], cache_seqlens=a["cache_seqlens"], out=a["out"],
                    **{n: x for n, x in a.items() if n not in ("q", "k_cache", "v_cache", "cache_seqlens", "out")})


def test_relocations_name_the_pointer_fields_of_the_planned_arrays():
    p = np.zeros(1, decode.FWD_PARAMS)
    p["q"], p["k"], p["lse"], p["batch"] = 0x1000, 0x2000, 0x9000, 0x1000  # (batch: an int32 of the same value)
    got = relocations(p, {"q": 0x1000, "k_cache": 0x2000, "out": 0x3000})
    assert sorted(got) == sorted([(decode.FWD_PARAMS.fields["q"][1], "q"), (decode.FWD_PARAMS.fields["k"][1], "k_cache")])


def test_run_hands_the_driver_the_recorded_launches_at_new_addresses(plan):
    out = run(plan.plan)
    calls = plan.driver.calls
    assert [c["fn"] for c in calls] == [0xF1, 0xF2] and all(c["stream"] == 0x5EA for c in calls)
    assert [c["pdl"] for c in calls] == [0, 1]  # the combine as the split kernel's programmatic dependent
    assert calls[0]["grid"] == (4, 2, 2) and calls[1]["grid"] == (4, 1, 1)
    fwd = np.frombuffer(calls[0]["params"], decode.FWD_PARAMS)[0]
    comb = np.frombuffer(calls[1]["params"], decode.COMBINE_PARAMS)[0]
    for field in ("q", "k", "v", "o", "cache_seqlens"):
        assert int(fwd[field]) == int(plan.fwd[field][0]) + 0x100000, field
    for field in ("o_partial", "lse_partial", "lse", "batch", "page_table"):  # scratch, sizes, absent arrays
        assert int(fwd[field]) == int(plan.fwd[field][0]), field
    assert int(comb["o"]) == int(plan.comb["o"][0]) + 0x100000 and int(comb["o_partial"]) == SCRATCH
    assert int(comb["num_splits"]) == 4
    assert out.data.ptr == 0x800000


@pytest.mark.parametrize("name, bad, message", [
    ("q", FakeCupyArray((2, 1, 8, 64), np.float16, 0x10000), "q must have the planned shape"),
    ("k_cache", FakeCupyArray((2, 512, 2, 128), np.float32, 0x200000), "k_cache must have the planned"),
    ("out", FakeCupyArray((2, 1, 8, 128), np.float16, 0x700000, device=1), "out must have the planned"),
    ("cache_seqlens", FakeCupyArray((2,), np.int32, 0x600004), "cache_seqlens must start at an address as aligned"),
    ("page_table", FakeCupyArray((2, 8), np.int32, 0xA00000), "page_table: this plan was made without it"),
    ("cache_seqlens", None, "cache_seqlens: this plan was made with it"),
    ("out", FakeCupyArray((2, 1, 8, 128), np.float16, 0x110000), "out must not be q itself"),
])
def test_run_refuses_arrays_unlike_the_planned_ones(plan, name, bad, message):
    with pytest.raises(ValueError, match=message):
        run(plan.plan, **{name: bad})
    assert not plan.driver.calls  # refused before any launch


def test_plan_kvcache_needs_an_int32_array_of_lengths_and_out():
    q = FakeCupyArray((1, 1, 8, 128), np.float16, 0x10000)
    with pytest.raises(TypeError, match="cache_seqlens as an int32 array"):
        cuflash.plan_kvcache(q, q, q, cache_seqlens=5, out=q)
    with pytest.raises(TypeError, match="needs out="):
        cuflash.plan_kvcache(q, q, q, cache_seqlens=q, out=None)
    assert {"plan_kvcache", "DecodePlan"} <= set(cuflash.__all__)
