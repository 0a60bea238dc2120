"""Streams and CUDA graphs (GPU tier).

Streams: cuflash launches on the caller's current stream (CuPy's, or torch's for torch tensors). The
tests produce the inputs on a non-default stream *behind a ~50 ms spin kernel*, into buffers that held
NaN before, call cuflash inside the stream context, and read the results after synchronising that
stream only: a launch on any other stream (the legacy default one, say) would read NaN or race with the
result check.

Graphs: ``stream.begin_capture()`` / ``cuflash...(...)`` / ``graph = stream.end_capture()``, then new
values are written *in place* into the captured inputs and ``graph.launch()`` replays; the captured
outputs must equal a fresh eager call on the new data (bit for bit for the forward and the
deterministic backward, by FlashAttention's tolerance rule against the fp32 reference for the
atomic-add backward). How to capture cuflash correctly:

* call the same function once eagerly first: the first call of a kernel variant compiles it (NVRTC)
  and loads the module, which must not happen during capture;
* cuflash allocates its outputs and scratch (LSE, the fp32 dQ accumulator, D, the deterministic
  semaphores) from CuPy's current allocator inside the call. Under capture each allocation happens
  once, and the graph writes to those addresses on every replay; the caller must keep the captured
  output arrays and read them after each replay. Scratch arrays are returned to the pool when the call
  ends although the graph still uses them, so the capture here allocates from a private
  ``cupy.cuda.MemoryPool`` that nothing else allocates from while the graph lives (as torch does with
  its graph pools). The allocator used during capture here poisons (NaN) each new block with a
  captured memset, so every replay re-poisons the outputs before the kernels write them: an element a
  replay does not write fails the check;
* the variable-length functions must be called with ``validate=False``: ``validate=True`` copies
  cu_seqlens to the host, which CuPy refuses during capture with a ``RuntimeError`` ("the current
  stream is capturing, so D2H transfers are disallowed", raised by
  ``MemoryPointer.copy_to_host_async`` before any CUDA call, so the capture itself stays valid). The
  captured kernels read cu_seqlens from device memory on every replay, so new offsets written in
  place (same batch size, lengths within the captured maxima) are honoured.
"""
import numpy as np
import pytest

import cuflash
from cuflash import reference as ref
from cuflash.bench import capture_on_stream

pytestmark = pytest.mark.gpu

B, SQ, SK, H, HKV, D = 2, 401, 333, 8, 2, 64  # Sq > Sk: causal rows at the top see no key (lse -inf)
SPIN_CYCLES = 100_000_000  # ~50 ms of GPU time

_SPIN_SRC = r"""
extern "C" __global__ void cuflash_test_spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
"""


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _need(impl):
    if impl not in cuflash.available_impls():
        pytest.skip(f"impl {impl!r} does not run on this GPU")


def _spin():
    """Keep the current stream busy for ~50 ms."""
    import cupy

    cupy.RawKernel(_SPIN_SRC, "cuflash_test_spin")((1,), (1,), (np.int64(SPIN_CYCLES),))


def _rand(rng, shape, dtype=None):
    """Random bf16 values made on the current CuPy stream."""
    import cupy

    return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype or _bf16())


def _copy_into(dst, src):
    """dst[...] = src as a device-to-device copy on the current stream (contiguous, same dtype/shape)."""
    assert dst.shape == src.shape and dst.dtype == src.dtype
    assert dst.flags.c_contiguous and src.flags.c_contiguous
    dst.data.copy_from_device_async(src.data, src.nbytes)


def _nan_filled_copies(*arrays):
    """Fresh buffers shaped like ``arrays`` holding NaN (all bits set), written synchronously."""
    import cupy

    out = []
    for a in arrays:
        b = cupy.empty_like(a)
        b.data.memset_async(0xFF, b.nbytes)
        out.append(b)
    cupy.cuda.get_current_stream().synchronize()
    return out


def _same_bits(name, a, b):
    import cupy

    if a.dtype == cupy.float32:
        eq = (a == b) | (cupy.isnan(a) & cupy.isnan(b))
    else:
        eq = a.view(cupy.uint16) == b.view(cupy.uint16)
    n = int((~eq).sum())
    assert n == 0, f"{name}: {n} of {a.size} elements differ from the eager call"


def _check_forward(out, lse, q, k, v, causal=True):
    o_ref, lse_ref = ref.attention_ref(q, k, v, causal=causal)
    o_low, _ = ref.attention_ref_lowp(q, k, v, causal=causal)
    ref.check_close("out", out, o_ref, o_low)
    ref.check_close("lse", lse, lse_ref, lse_ref, atol=2e-3)


def _check_backward(grads, dout, q, k, v, causal=True):
    g_ref = ref.attention_ref_backward(dout, q, k, v, causal=causal)
    g_low = ref.attention_ref_backward_lowp(dout, q, k, v, causal=causal)
    for name, g, gr, gl in zip(("dq", "dk", "dv"), grads, g_ref, g_low):
        ref.check_close(name, g, gr, gl)


def _varlen_case(rng, lens_q, lens_k, extra_rows=3):
    import cupy

    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = _rand(rng, (int(cu_q[-1]) + extra_rows, H, D))
    k = _rand(rng, (int(cu_k[-1]) + extra_rows, HKV, D))
    v = _rand(rng, (int(cu_k[-1]) + extra_rows, HKV, D))
    return q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k), cu_q, cu_k


def _check_varlen(out, lse, q, k, v, cu_q, cu_k, causal=True):
    """Per sequence against the reference (batch of 1); rows of no sequence are 0 / -inf."""
    import cupy

    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if qe == qs:
            continue
        if ke == ks:
            assert float(cupy.abs(out[qs:qe].astype(cupy.float32)).max()) == 0.0
            assert bool((lse[:, qs:qe] == -cupy.inf).all())
            continue
        o_ref, lse_ref = ref.attention_ref(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], causal=causal)
        o_low, _ = ref.attention_ref_lowp(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], causal=causal)
        ref.check_close(f"out[{b}]", out[None, qs:qe], o_ref, o_low)
        ref.check_close(f"lse[{b}]", lse[None, :, qs:qe], lse_ref, lse_ref, atol=2e-3)
    if int(cu_q[-1]) < out.shape[0]:  # rows after the last sequence belong to none
        tail = slice(int(cu_q[-1]), None)
        assert float(cupy.abs(out[tail].astype(cupy.float32)).max()) == 0.0
        assert bool((lse[:, tail] == -cupy.inf).all())


# ----------------------------------------------------------------------------------------------------
# non-default streams
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["fa2", "fa1"])
def test_cupy_non_default_stream(poison_allocations, impl):
    import cupy

    _need(impl)
    rng = np.random.default_rng()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        src = [_rand(rng, (B, SQ, H, D)), _rand(rng, (B, SK, HKV, D)), _rand(rng, (B, SK, HKV, D)),
               _rand(rng, (B, SQ, H, D))]
        q, k, v, dout = _nan_filled_copies(*src)
        _spin()
        for dst, s in zip((q, k, v, dout), src):
            _copy_into(dst, s)  # the inputs exist only after the spin, on this stream
        out, lse = cuflash.flash_attn_func(q, k, v, causal=True, return_lse=True, impl=impl)
        grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, impl=impl)
    stream.synchronize()
    with stream:
        _check_forward(out, lse, *src[:3])
        _check_backward(grads, src[3], *src[:3])


def test_cupy_non_default_stream_varlen(poison_allocations):
    import cupy

    _need("fa2")
    rng = np.random.default_rng()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        q0, k0, v0, cu_q0, cu_k0, hq, hk = _varlen_case(rng, [113, 0, 1, 239], [239, 5, 0, 113])
        q, k, v, cu_q, cu_k = _nan_filled_copies(q0, k0, v0, cu_q0, cu_k0)
        _spin()
        for dst, s in zip((q, k, v, cu_q, cu_k), (q0, k0, v0, cu_q0, cu_k0)):
            _copy_into(dst, s)
        out, lse = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 239, 239, causal=True, return_lse=True,
                                                  impl="fa2", validate=False)
    stream.synchronize()
    with stream:
        _check_varlen(out, lse, q0, k0, v0, hq, hk)


def test_torch_non_default_stream():
    """The CuPy-level API with torch tensors made on a side torch stream: forward, backward, varlen."""
    import cupy

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA device")
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is missing")
    impls = cuflash.available_impls()
    if not impls:
        pytest.skip("no cuflash implementation runs on this GPU")
    side = torch.cuda.Stream()
    assert side.cuda_stream != torch.cuda.current_stream().cuda_stream
    side.wait_stream(torch.cuda.current_stream())
    results = {}
    with torch.cuda.stream(side):
        gen = torch.Generator(device="cuda").manual_seed(int(np.random.SeedSequence().entropy % 2**63))
        shapes = {"q": (B, SQ, H, D), "k": (B, SK, HKV, D), "v": (B, SK, HKV, D), "dout": (B, SQ, H, D)}
        t = {n: torch.full(s, float("nan"), device="cuda", dtype=torch.bfloat16) for n, s in shapes.items()}
        torch.cuda._sleep(SPIN_CYCLES)
        for x in t.values():
            x.normal_(generator=gen)  # written on the side stream after the sleep
        for impl in impls:
            out, lse = cuflash.flash_attn_func(t["q"], t["k"], t["v"], causal=True, return_lse=True, impl=impl)
            assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
            grads = None
            if impl in cuflash.available_impls("backward"):
                grads = cuflash.flash_attn_backward(t["dout"], t["q"], t["k"], t["v"], out, lse, causal=True,
                                                    impl=impl)
            results[impl] = (out, lse, grads)
        if "fa2" in impls:
            cu = torch.tensor([0, 150, 150, 333], dtype=torch.int32, device="cuda")
            kp, vp = t["k"].reshape(B * SK, HKV, D), t["v"].reshape(B * SK, HKV, D)
            qp = t["q"].reshape(B * SQ, H, D)[: 2 * SK]
            cu_q = torch.tensor([0, 200, 400, 666], dtype=torch.int32, device="cuda")
            results["varlen"] = cuflash.flash_attn_varlen_func(qp, kp, vp, cu_q, cu, 266, 183, causal=True,
                                                               return_lse=True, impl="fa2", validate=False)
    side.synchronize()

    def cp(x):
        return cupy.from_dlpack(x.detach())

    q, k, v, dout = (cp(t[n]) for n in ("q", "k", "v", "dout"))
    for impl in impls:
        out, lse, grads = results[impl]
        _check_forward(cp(out), cp(lse), q, k, v)
        if grads is not None:
            _check_backward([cp(g) for g in grads], dout, q, k, v)
    if "varlen" in results:
        out, lse = results["varlen"]
        qp, kp, vp = q.reshape(B * SQ, H, D)[: 2 * SK], k.reshape(B * SK, HKV, D), v.reshape(B * SK, HKV, D)
        _check_varlen(cp(out), cp(lse), qp, kp, vp, np.array([0, 200, 400, 666]), np.array([0, 150, 150, 333]))


# ----------------------------------------------------------------------------------------------------
# CUDA graphs
# ----------------------------------------------------------------------------------------------------

def _poisoned(pool):
    """An allocator drawing from ``pool`` that fills each new block with 0xFF bytes (NaN) on the current
    stream; under capture the memset becomes a graph node, replayed before the kernels."""
    import cupy

    def malloc(size):
        mem = pool.malloc(size)
        if size:
            cupy.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cupy.cuda.get_current_stream().ptr)
        return mem

    return malloc


def _capture(stream, pool, fn):
    """(graph, fn()) with fn's work captured on ``stream`` and its allocations taken from ``pool``."""
    import cupy

    with cupy.cuda.using_allocator(_poisoned(pool)):
        graph, result = capture_on_stream(stream, fn)
    assert not stream.is_capturing()
    return graph, result


@pytest.fixture
def graph_pool():
    import cupy

    pool = cupy.cuda.MemoryPool()
    yield pool
    pool.free_all_blocks()


@pytest.mark.parametrize("impl", ["fa2", "fa1"])
def test_graph_forward(graph_pool, impl):
    import cupy

    _need(impl)
    rng = np.random.default_rng()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        q, k, v = _rand(rng, (B, SQ, H, D)), _rand(rng, (B, SK, HKV, D)), _rand(rng, (B, SK, HKV, D))

        def call():
            return cuflash.flash_attn_func(q, k, v, causal=True, return_lse=True, impl=impl)

        call()  # compile and load outside the capture
        stream.synchronize()
        graph, (out_g, lse_g) = _capture(stream, graph_pool, call)
        for trial in range(3):
            if trial:  # new inputs, in place
                for dst, shape in ((q, (B, SQ, H, D)), (k, (B, SK, HKV, D)), (v, (B, SK, HKV, D))):
                    _copy_into(dst, _rand(rng, shape))
            graph.launch(stream)
            out_e, lse_e = call()
            stream.synchronize()
            _same_bits("out", out_g, out_e)
            _same_bits("lse", lse_g, lse_e)
            if trial != 1:
                _check_forward(out_g, lse_g, q, k, v)
        del graph


@pytest.mark.parametrize("impl,deterministic", [("fa2", False), ("fa2", True), ("fa1", False)])
def test_graph_backward(graph_pool, impl, deterministic):
    import cupy

    _need(impl)
    rng = np.random.default_rng()
    stream = cupy.cuda.Stream(non_blocking=True)
    shapes = ((B, SQ, H, D), (B, SK, HKV, D), (B, SK, HKV, D), (B, SQ, H, D))
    with stream:
        q, k, v, dout = (_rand(rng, s) for s in shapes)
        out, lse = cuflash.flash_attn_func(q, k, v, causal=True, return_lse=True, impl=impl)

        def call():
            return cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, impl=impl,
                                               deterministic=deterministic)

        call()
        stream.synchronize()
        graph, grads_g = _capture(stream, graph_pool, call)
        for trial in range(3):
            if trial:  # new q, k, v, dout in place, and the matching out / lse written into the captured ones
                for dst, s in zip((q, k, v, dout), shapes):
                    _copy_into(dst, _rand(rng, s))
                o_new, l_new = cuflash.flash_attn_func(q, k, v, causal=True, return_lse=True, impl=impl)
                _copy_into(out, o_new)
                _copy_into(lse, l_new)
            graph.launch(stream)
            grads_e = call()
            stream.synchronize()
            if deterministic:
                for name, a, b in zip(("dq", "dk", "dv"), grads_g, grads_e):
                    _same_bits(name, a, b)
            _check_backward(grads_g, dout, q, k, v)
        del graph


@pytest.mark.parametrize("impl", ["fa2", "fa1"])
def test_graph_forward_backward(graph_pool, impl):
    """A training-step shape: forward and backward in one graph, the backward reading the forward's
    captured out / lse."""
    import cupy

    _need(impl)
    rng = np.random.default_rng()
    stream = cupy.cuda.Stream(non_blocking=True)
    shapes = ((B, SQ, H, D), (B, SK, HKV, D), (B, SK, HKV, D), (B, SQ, H, D))
    with stream:
        q, k, v, dout = (_rand(rng, s) for s in shapes)

        def call():
            out, lse = cuflash.flash_attn_func(q, k, v, causal=True, return_lse=True, impl=impl)
            return out, lse, cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, impl=impl)

        call()
        stream.synchronize()
        graph, (out_g, lse_g, grads_g) = _capture(stream, graph_pool, call)
        for trial in range(2):
            if trial:
                for dst, s in zip((q, k, v, dout), shapes):
                    _copy_into(dst, _rand(rng, s))
            graph.launch(stream)
            out_e, lse_e, _ = call()
            stream.synchronize()
            _same_bits("out", out_g, out_e)
            _same_bits("lse", lse_g, lse_e)
            _check_forward(out_g, lse_g, q, k, v)
            _check_backward(grads_g, dout, q, k, v)
        del graph


def test_graph_varlen_forward(graph_pool):
    import cupy

    _need("fa2")
    rng = np.random.default_rng()
    stream = cupy.cuda.Stream(non_blocking=True)
    lens_q, lens_k = [113, 0, 1, 239, 64], [239, 5, 1, 113, 64]
    max_q, max_k = max(lens_q), max(lens_k)
    with stream:
        q, k, v, cu_q, cu_k, hq, hk = _varlen_case(rng, lens_q, lens_k)

        def call(validate=False):
            return cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True,
                                                  impl="fa2", validate=validate)

        call(validate=True)  # compiles (and checks the offsets once, outside the capture)
        stream.synchronize()
        graph, (out_g, lse_g) = _capture(stream, graph_pool, call)
        # trial 0: as captured; 1: new data in place; 2: new offsets in place (same batch, within the maxima)
        new_lens = ([64, 113, 0, 1, 239], [1, 239, 113, 5, 60])  # other boundaries, same totals and maxima
        for trial in range(3):
            if trial == 1:
                for dst in (q, k, v):
                    _copy_into(dst, _rand(rng, dst.shape))
            if trial == 2:
                hq = np.concatenate([[0], np.cumsum(new_lens[0])]).astype(np.int32)
                hk = np.concatenate([[0], np.cumsum(new_lens[1])]).astype(np.int32)
                assert hq[-1] <= q.shape[0] and hk[-1] <= k.shape[0]
                assert max(new_lens[0]) <= max_q and max(new_lens[1]) <= max_k
                _copy_into(cu_q, cupy.asarray(hq))
                _copy_into(cu_k, cupy.asarray(hk))
            graph.launch(stream)
            out_e, lse_e = call(validate=True)
            stream.synchronize()
            _same_bits("out", out_g, out_e)
            _same_bits("lse", lse_g, lse_e)
            _check_varlen(out_g, lse_g, q, k, v, hq, hk)
        del graph


def test_graph_varlen_validate_true_raises_during_capture():
    """validate=True needs cu_seqlens on the host; during capture CuPy refuses the device-to-host copy
    with a RuntimeError before issuing it, so the capture stays usable and the stream works after."""
    import cupy

    _need("fa2")
    rng = np.random.default_rng()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        q, k, v, cu_q, cu_k, hq, hk = _varlen_case(rng, [50, 7], [60, 9])

        def call(validate):
            return cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 50, 60, causal=True, return_lse=True,
                                                  impl="fa2", validate=validate)

        call(True)
        stream.synchronize()
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="captur"):
                call(True)
        finally:
            try:
                stream.end_capture()
            except Exception:  # noqa: BLE001 - only the capture state matters below
                pass
        assert not stream.is_capturing()
        out, lse = call(True)  # the stream is usable afterwards
        stream.synchronize()
        _check_varlen(out, lse, q, k, v, hq, hk)
