"""CPU tier: planned calls. A public call whose arrays' layout and options were seen before skips its checks
(cuflash.api._checked) and the FA3 forward's planning (fa3._PLANS): what is left per call is the tensor maps
at the arrays' addresses and one PreparedLaunch (the params struct's bytes with the per-call fields packed
in, through cuLaunchKernel). Fake arrays and a fake driver stand in for the GPU; the launches' arguments
are read back while the fake driver call lasts."""
import ctypes
import dataclasses
import itertools
import types

import numpy as np
import pytest

import cuflash
from cuflash import _jit, _tma, api, fa3, heuristics
from cuflash._validate import Dims


class FakeDriver:
    """libcuda's cuLaunchKernel: records the grid, block, shared memory, stream and each argument's bytes
    (tensor maps 128 bytes, the params struct ``struct_bytes`` long: the last argument)."""

    def __init__(self, struct_bytes: int):
        self.struct_bytes, self.calls = struct_bytes, []

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        n = len(params)
        args = [ctypes.string_at(params[i], 128) for i in range(n - 1)] + [ctypes.string_at(params[n - 1], self.struct_bytes)]
        self.calls.append(dict(fn=fn, grid=(gx, gy, gz), block=(bx, by, bz), smem=smem, stream=stream, args=args))
        return 0

    def cuGetErrorName(self, err, name_ref):
        name_ref._obj.value = b"CUDA_ERROR_LAUNCH_FAILED"
        return 0


_ADDRESSES = itertools.count(0x7F00_0000_0000, 1 << 24)


@dataclasses.dataclass
class FakeArray:
    """What the launch path reads of a CuPy array: shape, strides (bytes), dtype, data.ptr."""

    shape: tuple
    dtype: np.dtype
    strides: tuple = None
    data: object = None

    def __post_init__(self):
        self.dtype = np.dtype(self.dtype)
        if self.strides is None:
            step, strides = self.dtype.itemsize, []
            for s in reversed(self.shape):
                strides.append(step)
                step *= s
            self.strides = tuple(reversed(strides))
        self.data = types.SimpleNamespace(ptr=next(_ADDRESSES), device_id=0)
        self.ndim = len(self.shape)


@pytest.fixture
def fake_gpu(monkeypatch):
    """One fake sm_90 device of 132 SMs; maps encoded as their (ptr, layout) in the first 128 bytes."""
    import cupy

    driver = FakeDriver(fa3.PARAMS.itemsize)
    monkeypatch.setattr(fa3, "device_id", lambda: 0)
    monkeypatch.setattr(fa3, "_sm_count", lambda: 132)
    monkeypatch.setattr(_jit, "get_function", lambda variant: types.SimpleNamespace(ptr=0xF00D))
    monkeypatch.setattr(_jit, "_libcuda", lambda: driver)
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=None: FakeArray(tuple(np.atleast_1d(shape)), dtype))
    encoded = []

    def encode(ptr, dtype, shape, strides, box, swizzle):
        encoded.append((ptr, _tma.MapLayout(dtype, shape, strides, box, swizzle)))
        tmap = np.zeros(1, _tma.TENSOR_MAP)
        tmap["opaque"][0][0] = ptr
        return tmap

    monkeypatch.setattr(_tma, "_encode_tiled_cached", encode)
    _tma.encoded.cache_clear()
    yield types.SimpleNamespace(driver=driver, encoded=encoded)
    _tma.encoded.cache_clear()


STREAM = types.SimpleNamespace(ptr=0x5EA)


def same_fields(launched: bytes, want: np.ndarray) -> bool:
    """The launched struct's bytes hold ``want``'s fields (a numpy copy leaves the padding between them
    undefined, so the bytes are compared field by field)."""
    got = np.frombuffer(launched, dtype=want.dtype)
    return all(got[name].tobytes() == want[name].tobytes() for name in want.dtype.names)


def _struct(call) -> np.ndarray:
    return np.frombuffer(call["args"][-1], dtype=fa3.PARAMS)[0]


def _forward_arrays(b=2, s=1000, h=4, hk=2, d=128):
    q = FakeArray((b, s, h, d), "bfloat16")
    k, v = FakeArray((b, s, hk, d), "bfloat16"), FakeArray((b, s, hk, d), "bfloat16")
    out = FakeArray((b, s, h, d), "bfloat16")
    lse = FakeArray((b, h, s), "float32")
    return q, k, v, out, lse, Dims(b, s, s, h, hk, d, "bfloat16")


def test_prepared_launch_packs_the_per_call_fields_into_the_struct(fake_gpu):
    variant = fa3.fwd_variant(128, "bfloat16")
    p = np.zeros(1, fa3.PARAMS)
    p["seqlen_q"], p["scale_log2"], p["o"] = 777, 0.5, 0xBAD  # (a per-call field: the call's value wins)
    launch = _jit.PreparedLaunch(variant, (5, 3), p, ("o", "lse", "tail_tag"))
    maps = [np.full(16, i, dtype=np.uint64) for i in (1, 2)]
    launch([m.ctypes.data for m in maps], [0x1000, 0x2000, 2 ** 64 - 1], STREAM)
    (call,) = fake_gpu.driver.calls
    assert call["grid"] == (5, 3, 1) and call["block"] == (variant.threads, 1, 1)
    assert call["smem"] == variant.smem_bytes and call["stream"] == STREAM.ptr and call["fn"] == 0xF00D
    assert call["args"][:2] == [m.tobytes() for m in maps]
    want = p.copy()
    want["o"], want["lse"], want["tail_tag"] = 0x1000, 0x2000, 2 ** 64 - 1
    assert same_fields(call["args"][-1], want)


def test_prepared_launch_refuses_a_narrow_per_call_field(fake_gpu):
    with pytest.raises(TypeError, match="seqlen_q .* not 64-bit"):
        _jit.PreparedLaunch(fa3.fwd_variant(128, "bfloat16"), (1,), np.zeros(1, fa3.PARAMS), ("seqlen_q",))


def test_prepared_launch_names_the_driver_error(fake_gpu):
    fake_gpu.driver.cuLaunchKernel = lambda *a: 719
    launch = _jit.PreparedLaunch(fa3.fwd_variant(128, "bfloat16"), (1,), np.zeros(1, fa3.PARAMS), ())
    with pytest.raises(RuntimeError, match="CUDA_ERROR_LAUNCH_FAILED"):
        launch([], [], STREAM)


def test_forward_plans_once_per_layout_and_takes_each_calls_pointers(fake_gpu, monkeypatch):
    made = []
    plan = fa3._plan_forward
    monkeypatch.setattr(fa3, "_plan_forward", lambda *a: made.append(plan(*a)) or made[-1])
    q, k, v, out, lse, dims = _forward_arrays()
    window = (dims.seqlen_k, 0)  # causal
    fa3.forward(q, k, v, out, lse, dims, window, 0.125, STREAM)
    q2, k2, v2, out2, lse2, _ = _forward_arrays()  # the same layout at other addresses
    fa3.forward(q2, k2, v2, out2, lse2, dims, window, 0.125, STREAM)
    assert len(made) == 1
    first, second = fake_gpu.driver.calls
    for call, arrays in ((first, (q, k, v, out, lse)), (second, (q2, k2, v2, out2, lse2))):
        p = _struct(call)
        assert (p["o"], p["lse"]) == (arrays[3].data.ptr, arrays[4].data.ptr)
        assert (p["seqlen_q"], p["heads"], p["kv_heads"], p["window_left"]) == (1000, 4, 2, 1000)
        assert np.isclose(p["scale_log2"], 0.125 * np.log2(np.e))
        # the maps of Q, K, V and O, at this call's arrays
        assert [np.frombuffer(m, np.uint64)[0] for m in call["args"][:4]] == [a.data.ptr for a in arrays[:4]]
    assert first["args"][-1] != second["args"][-1]
    fa3.forward(q, k, v, out, lse, dims, window, 0.25, STREAM)  # another scale: another plan
    assert len(made) == 2


@pytest.mark.parametrize("causal", [False, True])
def test_long_rows_take_the_long_row_tiles(fake_gpu, monkeypatch, causal):
    """bf16 d = 128 calls of FA3_LONG_MIN_SEQLEN query rows and more launch FA3_TILES_LONG's variant (the tile
    order by plain division: FAST_TILE_DIV 0), shorter ones FA3_TILES' (the host's FastDivmods); both are
    among the variants the compile check builds."""
    launched = []
    monkeypatch.setattr(_jit, "get_function", lambda variant: launched.append(variant) or types.SimpleNamespace(ptr=1))
    n = heuristics.FA3_LONG_MIN_SEQLEN
    for s in (n - 1, n):
        q, k, v, out, lse, dims = _forward_arrays(1, s, 2, 2, 128)
        fa3.forward(q, k, v, out, lse, dims, (dims.seqlen_k, 0 if causal else dims.seqlen_q), 0.1, STREAM)
    short, long = (v for v in launched if v.kernel == "fa3_fwd")
    assert ("CUFLASH_FAST_TILE_DIV", 0) in long.defines and ("CUFLASH_FAST_TILE_DIV", 0) not in short.defines
    assert "CUFLASH_TAIL_SPLIT" in dict(long.defines)
    assert dict(long.defines)["CUFLASH_TAIL_SPLIT"] == dict(short.defines)["CUFLASH_TAIL_SPLIT"]
    names = {v.name for v in fa3.all_variants()}
    assert long.name in names and short.name in names


def test_each_call_of_a_stream_k_tail_gets_its_own_buffers_and_tag(fake_gpu):
    d = 128
    t = fa3.fwd_tiles(d, unmasked=True)
    sq = 768
    heads = 132 // -(-sq // fa3.fwd_block_m(t)) + 1  # one round of tiles and a few more (test_fa3_gpu's _tail_shape)
    q, k, v, out, lse, dims = _forward_arrays(1, sq, heads, heads, d)
    window = (dims.seqlen_k, dims.seqlen_q)  # unmasked
    fa3.forward(q, k, v, out, lse, dims, window, 0.1, STREAM)
    fa3.forward(q, k, v, out, lse, dims, window, 0.1, STREAM)
    first, second = (_struct(c) for c in fake_gpu.driver.calls)
    assert first["tail_units"] > 0 and first["tail_partials"] and first["tail_flags"]
    assert first["tail_partials"] != second["tail_partials"] and first["tail_tag"] != second["tail_tag"]
    assert first["tail_tag"] and second["tail_tag"]


def test_clear_plans_makes_the_next_call_read_the_tables_again(fake_gpu, monkeypatch):
    q, k, v, out, lse, dims = _forward_arrays()
    window = (dims.seqlen_k, 0)
    fa3.forward(q, k, v, out, lse, dims, window, 0.125, STREAM)
    tiles = fa3.fwd_tiles(128)
    monkeypatch.setitem(heuristics.FA3_TILES, 128, dataclasses.replace(tiles, stages=tiles.stages + 1))
    fa3.forward(q, k, v, out, lse, dims, window, 0.125, STREAM)  # (still the plan made before the edit)
    cuflash.clear_plans()
    fa3.forward(q, k, v, out, lse, dims, window, 0.125, STREAM)
    smems = [c["smem"] for c in fake_gpu.driver.calls]
    assert smems[0] == smems[1] != smems[2]


class _KeyedCall:
    """What api._checked reads of a Call: its layout key and device."""

    def __init__(self, layout):
        self.layout, self.device = layout, types.SimpleNamespace(id=0)


@pytest.fixture
def counted_check(monkeypatch):
    monkeypatch.setattr(cuflash._device, "compute_capability", lambda device=0: (9, 0))
    seen = []

    def check():
        seen.append(1)
        return ("dims", "plan")
    return seen, check


def test_a_layout_seen_before_skips_its_checks(counted_check):
    seen, check = counted_check
    call = _KeyedCall((((2, 8, 4, 64), (4096, 512, 128, 2), "bfloat16", 0, 0),))
    for _ in range(3):
        assert api._checked(call, ("forward", "auto", True, None), check) == ("dims", "plan")
    assert len(seen) == 1
    api._checked(_KeyedCall(call.layout[0][:4] + (8,)), ("forward", "auto", True, None), check)  # unaligned data
    api._checked(call, ("forward", "auto", False, None), check)
    assert len(seen) == 3


def test_options_of_other_types_that_compare_equal_are_checked_apart(counted_check):
    """softcap=False is refused where 0.0 is taken: the memo must not hand one the other's outcome."""
    seen, check = counted_check
    call = _KeyedCall(("layout",))
    api._checked(call, ("forward", 0.0), check)
    api._checked(call, ("forward", False), check)
    api._checked(call, ("forward", 0), check)
    assert len(seen) == 3
    api._checked(call, ("forward", (-1, -1)), check)
    api._checked(call, ("forward", (-1.0, -1.0)), check)  # (refused as a window_size where (-1, -1) is taken)
    assert len(seen) == 5


def test_unkeyed_calls_and_unhashable_options_are_checked_every_time(counted_check):
    seen, check = counted_check
    for _ in range(2):
        api._checked(_KeyedCall(None), ("forward",), check)
        api._checked(_KeyedCall(("layout",)), ("forward", [-1, -1]), check)  # a list window_size
        api._checked(_KeyedCall(("layout",)), ("forward",), check, alibi_slopes=object())  # (its plan holds them)
    assert len(seen) == 6


def test_a_refused_call_is_not_remembered(counted_check):
    seen, _ = counted_check

    def refuse():
        seen.append(1)
        raise ValueError("refused")
    for _ in range(2):
        with pytest.raises(ValueError):
            api._checked(_KeyedCall(("layout",)), ("forward",), refuse)
    assert len(seen) == 2
