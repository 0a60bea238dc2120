"""FA3 (Hopper) forward against the fp32 reference by FlashAttention's tolerance rule (GPU tier, sm_90
only), outputs poisoned: head dims (96 is stored padded to 128), causal, window, softcap, GQA/MQA, odd
lengths (1, 113, 239, 1023, 4224), Sq != Sk both ways, fp16, strided inputs, many tiles per persistent
block, variable-length (packed) batches."""
import numpy as np
import pytest

import cuflash
from cuflash import fa3
from cuflash import reference as ref
from gpu_checks import check_backward, check_forward, check_varlen_backward, check_varlen_forward, varlen_batch
from gpu_checks import inputs as _inputs
from gpu_checks import rising_maxima_inputs
from gpu_checks import with_exp2_emu

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper_only():
    from cuflash import _device

    if _device.has_gpu() and _device.compute_capability() != (9, 0):
        pytest.skip("FA3 kernels are built for sm_90a")


HEADDIMS = (64, 96, 128, 192, 256)
SEQLENS = [(113, 239), (239, 113), (1, 1023), (1023, 1023), (4224, 129), (7, 1)]
HEADS = [(4, 4), (6, 2), (4, 1)]


def _check(q, k, v, causal=False, window=(-1, -1), softcap=0.0):
    check_forward("fa3", q, k, v, causal=causal, window_size=window, softcap=softcap)


@pytest.mark.parametrize("d", HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", SEQLENS)
@pytest.mark.parametrize("heads", HEADS)
def test_forward(poison_allocations, d, causal, seqlens, heads):
    b = 1 if seqlens[0] > 2000 else 2
    q, k, v = _inputs(np.random.default_rng(), b, *seqlens, *heads, d, "bfloat16")
    _check(q, k, v, causal)


@pytest.mark.parametrize("speculative", [False, True], ids=["after-max", "speculative"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_d128_where_row_maxima_rise(poison_allocations, monkeypatch, speculative, causal, softcap):
    """d = 128 with the speculative max (fwd.cu SPECULATIVE_MAX: a tile's exponentials from the running max;
    heuristics.FA3_TILES) and without: keys 128-255 scaled 4x and the rest 16x, so every row's max rises more
    than 2^8-fold after its first tiles, and one late key that only the first 16 query rows of each 128-row
    block (one warp of a consumer) align with, so one warp's vote makes its warpgroup recompute S while its
    previous P V is in flight (the intra-warpgroup overlap)."""
    import dataclasses

    from cuflash import heuristics

    tiles = heuristics.FA3_TILES[128]
    monkeypatch.setitem(heuristics.FA3_TILES, 128, dataclasses.replace(tiles, speculative_max=speculative))
    q, k, v = rising_maxima_inputs(np.random.default_rng(), 700, 1500, 128, 1400)
    _check(q, k, v, causal, softcap=softcap)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (100, 3)])
@pytest.mark.parametrize("seqlens", [(113, 239), (600, 600), (1023, 1100)])
def test_forward_with_two_q_buffers(poison_allocations, monkeypatch, d, window, seqlens):
    """Two Q buffers (heuristics.Fa3Tiles.q_stages 2, fwd.cu Q_STAGES): the producer loads the next tile's Q
    while this tile runs, so the buffers alternate by tile and each has its own phase. Short and long rows,
    causal (two consumers at d = 64's short rows, three from 1k) and a window, many tiles per persistent block
    (8 heads, batch 3), the tail of unmasked calls; every table row at the head dim takes the setting."""
    import dataclasses

    from cuflash import heuristics

    for table in (heuristics.FA3_TILES, heuristics.FA3_TILES_UNMASKED, heuristics.FA3_TILES_3WG,
                  heuristics.FA3_TILES_SHORT_MASKED, heuristics.FA3_TILES_LONG):
        if d in table:
            monkeypatch.setitem(table, d, dataclasses.replace(table[d], q_stages=2))
    q, k, v = _inputs(np.random.default_rng(), 3, *seqlens, 8, 4, d, "bfloat16")
    _check(q, k, v, window=window)


@pytest.mark.parametrize("rows", ["short", "long"])
@pytest.mark.parametrize("seqlens", [(239, 1023), (1023, 239), (1023, 1023)])
@pytest.mark.parametrize("window", [(-1, 0), (100, 3)])
def test_masked_d64_with_two_and_three_consumers(poison_allocations, monkeypatch, rows, seqlens, window):
    """Masked rows at d = 64 take two consumer warpgroups below heuristics.FA3_3WG_MIN_MASKED_SEQLEN and
    three from there on: both arrangements under a causal mask and a window, at odd lengths (the bound
    lowered to 0 puts these short rows on three)."""
    from cuflash import heuristics

    if rows == "long":
        monkeypatch.setattr(heuristics, "FA3_3WG_MIN_MASKED_SEQLEN", 0)
    q, k, v = _inputs(np.random.default_rng(), 2, *seqlens, 4, 2, 64, "bfloat16")
    _check(q, k, v, window=window)


@pytest.mark.parametrize("seqlens", [(2048, 2048), (2200, 2200), (2048, 3000), (3000, 2500), (4096, 4096)])
@pytest.mark.parametrize("window", [(-1, 0), (300, 0)])
def test_three_consumers_with_rows_before_zero(poison_allocations, seqlens, window):
    """Causal d = 64 from 2k rows: tiles of 192 rows, the spare rows of a length that is no multiple of
    192 before row 0 (fa3.fill_schedule's row_shift, whole warpgroups of 64 rows; every causal case here
    takes one): Q rows loaded from before the tensor (zero-filled by TMA), their O and LSE never written; Sq < Sk and Sq > Sk, and a
    window (which takes the shift where it saves K tiles: 2048 and 4096 rows)."""
    from cuflash import _validate, tile_order

    sq, sk = seqlens
    dims = _validate.Dims(1, sq, sk, 4, 2, 64, "bfloat16")
    bounds = _validate.window_bounds(window, False, dims)
    shift = tile_order.row_shift(-(-sq // 192), 192, 128, sq, sk, bounds)[0]
    assert shift > 0 or window != (-1, 0)
    q, k, v = _inputs(np.random.default_rng(), 1, sq, sk, 4, 2, 64, "bfloat16")
    _check(q, k, v, window=window)


@pytest.mark.parametrize("emu", [4, 2])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(239, 1023), (1023, 239), (77, 300)])
def test_forward_exponentials_on_the_fma_pipe(poison_allocations, monkeypatch, emu, d, causal, seqlens):
    """The softmax with a quarter (emu = 4) or half (2) of its exponentials through poly_exp2: masked scores
    (causal, the last partial tile) weigh exactly 0, rows that see no key (Sq > Sk causal) give O = 0 and
    LSE = -inf, persistent blocks walk several tiles. (The variants are those scripts/fa3_exp2_probe.py
    --precompile-only compiles; these shapes take no GQA packing.)"""
    with_exp2_emu(monkeypatch, emu)
    q, k, v = _inputs(np.random.default_rng(), 2, *seqlens, 4, 2, d, "bfloat16")
    _check(q, k, v, causal)


@pytest.mark.parametrize("d", HEADDIMS)
@pytest.mark.parametrize("window", [(32, 0), (17, 40), (-1, 5)])
def test_window(poison_allocations, d, window):
    q, k, v = _inputs(np.random.default_rng(), 2, 239, 300, 4, 2, d, "bfloat16")
    _check(q, k, v, window=window)


@pytest.mark.parametrize("d", HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_blocks_walk_many_tiles(poison_allocations, d, causal):
    """384 tiles on 132 SMs: each persistent block runs ~3 tiles, so the K/V ring's phases, the Q
    buffer's reload and the pingpong turns carry across tiles."""
    q, k, v = _inputs(np.random.default_rng(), 3, 1023, 1023, 16, 4, d, "bfloat16")
    _check(q, k, v, causal)


def _tail_shape(d, softcap=False, group=1):
    """(query rows, keys, heads) of an unmasked call at head dim d whose tiles are one round of the
    persistent grid and a few more: the stream-K tail (fa3.fill_tail) splits those over the keys."""
    t = fa3.fwd_tiles(d, unmasked=True, softcap=softcap)
    sq, sk = 768, 913
    m_blocks = -(-sq // fa3.fwd_block_m(t))
    heads = -(-(fa3._sm_count() // m_blocks + 1) // group) * group
    return sq, sk, heads


def _spy_tail(monkeypatch):
    """fa3.fill_tail's results, call by call."""
    made, fill = [], fa3.fill_tail
    monkeypatch.setattr(fa3, "fill_tail", lambda *a, **kw: made.append(fill(*a, **kw)) or made[-1])
    return made


@pytest.mark.parametrize("d", HEADDIMS)
@pytest.mark.parametrize("case", ["plain", "gqa", "softcap", "fp16", "d_v"])
def test_forward_stream_k_tail(poison_allocations, monkeypatch, d, case):
    """One round of tiles and a few more: the rest are split over the keys into pieces on every block, each
    tile's pieces merged by the block holding its last (partials through global memory, flags with the
    call's tag). Every head dim, GQA (without packing), softcap, fp16, and a narrower V (FWD_HEADDIM_V);
    the split must have been taken."""
    if case == "d_v" and d not in fa3.FWD_HEADDIM_V:
        pytest.skip("no narrower V at this head dim")
    group = 2 if case == "gqa" else 1
    sq, sk, heads = _tail_shape(d, case == "softcap", group)
    made = _spy_tail(monkeypatch)
    rng = np.random.default_rng()
    dtype = "float16" if case == "fp16" else "bfloat16"
    q, k, v = _inputs(rng, 1, sq, sk, heads, heads // group, d, dtype)
    if case == "d_v":  # (O has V's head dim: not check_forward's shape)
        v = v[..., : fa3.FWD_HEADDIM_V[d][0]].copy()
        out, lse = cuflash.flash_attn_func(q, k, v, return_lse=True, impl="fa3")
        o_ref, lse_ref = ref.attention_ref(q, k, v)
        ref.check_close("out", out, o_ref, ref.attention_ref_lowp(q, k, v)[0])
        ref.check_close("lse", lse, lse_ref, lse_ref, atol=2e-3)
    elif case == "softcap":
        _check(q * 4, k, v, softcap=5.0)
    else:
        _check(q, k, v)
    assert len(made) == 1 and made[0] is not None, "the call took no stream-K tail"


def test_forward_stream_k_tail_replays_in_a_graph(monkeypatch):
    """A captured call carries one tag: each merging block resets the flags it waited on, so every replay
    (new inputs in place) waits for its own partials again and equals an eager call bit for bit."""
    import cupy

    from cuflash.bench import capture_on_stream

    sq, sk, heads = _tail_shape(128)
    made = _spy_tail(monkeypatch)
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, 1, sq, sk, heads, heads, 128, "bfloat16")
    stream = cupy.cuda.Stream(non_blocking=True)
    pool = cupy.cuda.MemoryPool()
    with stream:
        cuflash.flash_attn_func(q, k, v, impl="fa3")  # compile and load outside the capture
        stream.synchronize()
        with cupy.cuda.using_allocator(pool.malloc):
            graph, (out_g, lse_g) = capture_on_stream(
                stream, lambda: cuflash.flash_attn_func(q, k, v, return_lse=True, impl="fa3"))
        for trial in range(3):
            for dst in (q, k, v):
                dst[...] = cupy.asarray(rng.standard_normal(dst.shape, dtype=np.float32)).astype(dst.dtype)
            graph.launch(stream)
            out_e, lse_e = cuflash.flash_attn_func(q, k, v, return_lse=True, impl="fa3")
            stream.synchronize()
            assert bool((out_g.view("uint16") == out_e.view("uint16")).all()), trial
            assert bool((lse_g == lse_e).all()), trial
        check_forward("fa3", q, k, v)
    assert all(m is not None for m in made)
    del graph
    pool.free_all_blocks()


@pytest.mark.parametrize("d", (64, 96, 128))
@pytest.mark.parametrize("sk", (1, 100, 128, 129, 300, 1000))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_forward_several_short_tiles_per_block(poison_allocations, d, sk, causal, dtype):
    """Several tiles per persistent block (1000 query rows x 20 heads x 2: 320 tiles of 128 rows) of one K
    tile (sk <= 128), two, three or eight, one after another: the K / V ring's slots and phases and the Q
    buffer's carry on across tiles. Causal (bottom-right) with Sq > Sk leaves the first Sq - Sk rows without
    keys: empty tiles (O = 0, LSE = -inf) between the others. d = 64 runs on two consumers here (rows bounded
    under heuristics.FA3_3WG_MIN_MASKED_SEQLEN: causal, or a window of 500 keys each side)."""
    window = (-1, 0) if causal else (500, 500) if d == 64 else (-1, -1)
    q, k, v = _inputs(np.random.default_rng(), 2, 1000, sk, 20, 4, d, dtype)
    _check(q, k, v, window=window)


@pytest.mark.parametrize("d", HEADDIMS)
def test_persistent_blocks_skip_empty_tiles(poison_allocations, d):
    """A window (0, 0) with Sq = 2000 > Sk = 300: query rows before 1700 see no key, so most tiles are
    empty (O = 0, LSE = -inf) and some blocks get only empty tiles; the rest must still be right."""
    q, k, v = _inputs(np.random.default_rng(), 2, 2000, 300, 16, 8, d, "bfloat16")
    _check(q, k, v, window=(0, 0))


@pytest.mark.parametrize("d", HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_softcap(poison_allocations, d, causal):
    q, k, v = _inputs(np.random.default_rng(), 2, 239, 300, 4, 2, d, "bfloat16")
    _check(q * 4, k, v, causal=causal, softcap=5.0)  # scores of a few units: the cap bends them


def test_softcap_with_window_and_fp16(poison_allocations):
    q, k, v = _inputs(np.random.default_rng(), 2, 300, 239, 6, 2, 128, "float16")
    _check(q, k, v, window=(40, 7), softcap=2.5)


@pytest.mark.parametrize("d", HEADDIMS)
def test_fp16(poison_allocations, d):
    q, k, v = _inputs(np.random.default_rng(), 2, 200, 333, 4, 2, d, "float16")
    _check(q, k, v, causal=True)


def test_strided_inputs(poison_allocations):
    import cupy

    qkv = cupy.asarray(np.random.default_rng().standard_normal((2, 177, 3, 4, 128), dtype=np.float32))
    qkv = qkv.astype("bfloat16")
    _check(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)


def test_misaligned_rows_are_refused_not_faulted():
    """A row pitch that breaks TMA's 16-byte rule is refused with a clear error before any kernel."""
    import cupy

    base = cupy.zeros((1, 64, 2, 64 + 4), dtype="bfloat16")
    q = base[..., :64]  # head stride 68 elements = 136 bytes: not a multiple of 16
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        cuflash.flash_attn_func(q, q, q, impl="fa3")


# --- GQA packing (few query rows: the group's heads share a tile) --------------------------------------------

@pytest.mark.parametrize("d", HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk, heads", [(1, 300, (8, 2)), (7, 1023, (16, 2)), (16, 129, (8, 1)), (33, 77, (4, 2)),
                                           (3, 1, (32, 2))])
def test_gqa_packing(poison_allocations, d, causal, sq, sk, heads):
    from cuflash import fa3
    from cuflash._validate import Dims

    assert fa3.pack_gqa(Dims(2, sq, sk, heads[0], heads[1], d, "bfloat16"), varlen=False)
    q, k, v = _inputs(np.random.default_rng(), 2, sq, sk, *heads, d, "bfloat16")
    _check(q, k, v, causal)


def test_gqa_packing_window_softcap_fp16_strided(poison_allocations):
    import cupy

    base = cupy.asarray(np.random.default_rng().standard_normal((3, 5, 3, 16, 128), dtype=np.float32)).astype("float16")
    q = base[:, :, 0]  # (3, 5, 16, 128) with the batch and row strides of the packed qkv tensor
    k, v = base[:, :, 1, :4], base[:, :, 2, :4]
    _check(q, k, v, window=(2, 1), softcap=4.0)


# --- variable-length batches ----------------------------------------------------------------------------

FA3_VARLEN_CASES = [
    ([113, 0, 1, 239, 64], [239, 5, 1, 113, 64]),  # empty and length-1 sequences, Sq != Sk both ways
    ([1, 1, 1], [1000, 0, 77]),  # empty K: rows see nothing (out 0, lse -inf)
    ([1500, 3, 700, 0, 129], [1500, 900, 3, 64, 129]),  # many tiles per persistent block, most sequences short
]


def _check_varlen(lens_q, lens_k, d, h=6, hkv=2, dtype="bfloat16", **options):
    rng = np.random.default_rng()
    q, k, v, cu_q, cu_k, hq, hk = varlen_batch(rng, lens_q, lens_k, h, hkv, d, dtype)
    out, lse = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True,
                                              impl="fa3", **options)
    check_varlen_forward(out, lse, q, k, v, hq, hk, **options)
    # rows after the last sequence belong to none: untouched zeros, LSE -inf
    assert float(abs(out[int(hq[-1]):].astype("float32")).max()) == 0.0
    assert bool((lse[:, int(hq[-1]):] == -np.inf).all())


@pytest.mark.parametrize("d", HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", FA3_VARLEN_CASES)
def test_varlen(d, causal, lens):
    _check_varlen(*lens, d, causal=causal)


def test_varlen_many_heads_window_softcap_fp16():
    _check_varlen([1500, 3, 700, 0, 129], [1500, 900, 3, 64, 129], 128, h=16, hkv=4, dtype="float16",
                  window_size=(100, 20), softcap=3.0)


def test_auto_picks_fa3_for_varlen():
    import cupy

    rng = np.random.default_rng()
    q, k, v, cu_q, cu_k, _, _ = varlen_batch(rng, [100, 50], [60, 200], 4, 2, 128)
    a = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 100, 200, causal=True)
    b = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 100, 200, causal=True, impl="fa3")
    assert bool(cupy.all(a.view("uint16") == b.view("uint16")))


# --- backward (head dims 64, 96, 128, 192, 256) -----------------------------------------------------------------

BWD_HEADDIMS = fa3.BWD_HEADDIMS  # 64, 96 (padded to 128), 128; 192 (padded to 256), 256 (bwd_wide.cu)


@pytest.mark.parametrize("d", BWD_HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(113, 239), (239, 113), (1, 300), (300, 1), (1023, 1023)])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)])
def test_backward(poison_allocations, d, causal, seqlens, heads):
    q, k, v = _inputs(np.random.default_rng(), 2, *seqlens, *heads, d, "bfloat16")
    check_backward("fa3", q, k, v, causal=causal)


@pytest.mark.parametrize("d", BWD_HEADDIMS)
@pytest.mark.parametrize("window", [(32, 0), (17, 40), (-1, 5)])
def test_backward_window(poison_allocations, d, window):
    q, k, v = _inputs(np.random.default_rng(), 2, 239, 300, 4, 2, d, "bfloat16")
    check_backward("fa3", q, k, v, window_size=window)


@pytest.mark.parametrize("d", BWD_HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_deterministic_is_bit_identical(d, causal):
    """Many K blocks add into each dQ row (TMA reduce-adds); the deterministic mode orders them by K block,
    so runs agree bit for bit (and match the reference). GQA: the group's heads add into their own rows."""
    q, k, v = _inputs(np.random.default_rng(), 2, 1100, 1300, 4, 2, d, "bfloat16")
    dout, out, lse, first = check_backward("fa3", q, k, v, causal=causal, deterministic=True)
    for _ in range(3):
        again = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, impl="fa3", deterministic=True)
        for a, b in zip(first, again):
            assert bool((a.view("uint16") == b.view("uint16")).all())


@pytest.mark.parametrize("d", BWD_HEADDIMS)
@pytest.mark.parametrize("planes", [1, 2, 8])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_backward_deterministic_dq_planes(monkeypatch, poison_allocations, d, planes, mask):
    """Deterministic mode with several dQ accumulator planes (fa3.bwd_dq_accumulators takes them without a
    mask, with few heads in the grid; forced here, with and without masks): K block n adds into plane
    n mod planes in its own descending order, the conversion sums the planes in order. Against the
    reference, bit-identical run to run (varlen too), and the launch really took that many planes."""
    import cupy

    from cuflash import _bwd_aux, heuristics

    monkeypatch.setattr(fa3, "bwd_dq_accumulators", lambda dims, window, plane_bytes, det: planes if det else 1)
    monkeypatch.setattr(heuristics, "FA3_BWD_ROTATE_SM_FRACTION", 0.0)  # (unmasked: the descending order too)
    seen = []  # the planes each launched dQ conversion sums (its params struct's accum_planes)
    launch = fa3._BackwardPlan.launch

    def spy(plan, *args, **kwargs):
        seen.append(int(np.frombuffer(plan.convert.template, _bwd_aux.PARAMS)["accum_planes"][0]))
        return launch(plan, *args, **kwargs)
    monkeypatch.setattr(fa3._BackwardPlan, "launch", spy)
    options = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(300, 40))}[mask]
    q, k, v = _inputs(np.random.default_rng(), 1, 1100, 1300, 3, 1, d, "bfloat16")
    dout, out, lse, first = check_backward("fa3", q, k, v, deterministic=True, **options)
    assert seen == [planes]
    again = cuflash.flash_attn_backward(dout, q, k, v, out, lse, impl="fa3", deterministic=True, **options)
    for a, b in zip(first, again):
        assert bool((a.view("uint16") == b.view("uint16")).all())
    seen.clear()
    rng = np.random.default_rng()
    dout, out, lse, first, (q, k, v, cu_q, cu_k, max_q, max_k) = check_varlen_backward(
        "fa3", rng, [700], [900], 2, 1, d, deterministic=True, **options)
    again = cuflash.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, impl="fa3",
                                               deterministic=True, **options)
    for a, b in zip(first, again):
        assert bool((cupy.asarray(a).view("uint16") == cupy.asarray(b).view("uint16")).all())
    assert seen == [planes, planes]


def test_backward_deterministic_with_a_window(poison_allocations):
    """A window changes which K blocks touch a Q block (the turn order starts at the first of them)."""
    q, k, v = _inputs(np.random.default_rng(), 1, 700, 900, 4, 4, 128, "bfloat16")
    check_backward("fa3", q, k, v, window_size=(200, 64), deterministic=True)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("seqlens,window", [((2048, 2048), (-1, 0)), ((1500, 1200), (-1, 0)), ((1100, 1300), (-1, 0)),
                                            ((2048, 2048), (300, 0))])
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_rows_before_zero(poison_allocations, d, seqlens, window, deterministic):
    """The spare rows of the last Q block before row 0 (tile_order.bwd_row_shift; every case here takes a
    shift): Q / dO rows before 0 zero-filled by TMA, the LSE / D padding (+inf, 0) and the dQ accumulator's
    rows before 0 (added to, never read), Sq > Sk and Sq < Sk, a window, the deterministic turns."""
    from cuflash import _validate, tile_order

    sq, sk = seqlens
    dims = _validate.Dims(1, sq, sk, 4, 2, d, "bfloat16")
    bounds = _validate.window_bounds(window, False, dims)
    assert tile_order.bwd_row_shift(sq, sk, bounds, fa3.bwd_block_m(d, False), fa3.bwd_block_n(d)) > 0
    q, k, v = _inputs(np.random.default_rng(), 1, sq, sk, 4, 2, d, "bfloat16")
    check_backward("fa3", q, k, v, window_size=window, deterministic=deterministic)


@pytest.mark.parametrize("d", BWD_HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_softcap(poison_allocations, d, causal):
    """Logits large enough that the cap matters (q scaled up): dS carries the cap's derivative 1 - t^2."""
    q, k, v = _inputs(np.random.default_rng(), 2, 150, 233, 8, 2, d, "bfloat16")
    q = (q.astype("float32") * 3).astype("bfloat16")
    check_backward("fa3", q, k, v, causal=causal, softcap=6.0)
    check_backward("fa3", q, k, v, causal=causal, softcap=6.0, deterministic=True)


BWD_VARLEN_CASES = [
    ([113, 0, 1, 239, 64], [239, 5, 1, 113, 64]),  # empty and length-1 sequences, Sq != Sk both ways
    ([300, 7, 1024], [300, 1, 1024]),
    ([1, 1, 1], [1000, 0, 77]),  # empty K: rows see nothing (dq 0)
]


@pytest.mark.parametrize("d", BWD_HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", BWD_VARLEN_CASES)
def test_varlen_backward(poison_allocations, d, causal, lens):
    """Packed batches: each block works in its sequence's rows; the LSE / D rows of every sequence start at a
    64-aligned row of the padded layout (sequences start anywhere in the packed rows)."""
    check_varlen_backward("fa3", np.random.default_rng(), *lens, 6, 2, d, causal=causal)


def test_varlen_backward_deterministic_softcap_window(poison_allocations):
    import cupy

    rng = np.random.default_rng()
    dout, out, lse, first, (q, k, v, cu_q, cu_k, max_q, max_k) = check_varlen_backward(
        "fa3", rng, [300, 7, 1024, 0, 65], [300, 1, 1100, 3, 200], 8, 2, 128, causal=True, softcap=5.0,
        deterministic=True)
    again = cuflash.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=True,
                                               softcap=5.0, deterministic=True, impl="fa3")
    for a, b in zip(first, again):
        assert bool((cupy.asarray(a).view("uint16") == cupy.asarray(b).view("uint16")).all())
    check_varlen_backward("fa3", rng, [200, 333], [500, 90], 4, 4, 64, window_size=(50, 20))


def test_backward_fp16_and_strided(poison_allocations):
    import cupy

    qkv = cupy.asarray(np.random.default_rng().standard_normal((2, 177, 3, 4, 128), dtype=np.float32)).astype("float16")
    check_backward("fa3", qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)


def test_backward_lse_view_not_16_byte_aligned(poison_allocations):
    """The LSE reaches the kernel through a flat-row tensor map, whose base must be 16-byte aligned: an LSE that is
    a view starting 4 bytes into its allocation (still contiguous) is copied first and gives the same
    dK/dV bits as the aligned one."""
    import cupy

    q, k, v = _inputs(np.random.default_rng(), 2, 113, 239, 4, 2, 128, "bfloat16")
    out, lse = cuflash.flash_attn_func(q, k, v, causal=True, return_lse=True, impl="fa3")
    shifted = cupy.empty(lse.size + 1, dtype=cupy.float32)[1:].reshape(lse.shape)
    shifted[...] = lse
    assert shifted.data.ptr % 16
    dout = cupy.asarray(np.random.default_rng(1).standard_normal(q.shape, dtype=np.float32)).astype("bfloat16")
    _, dk_a, dv_a = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, impl="fa3")
    _, dk_b, dv_b = cuflash.flash_attn_backward(dout, q, k, v, out, shifted, causal=True, impl="fa3")
    assert bool((dk_a.view("uint16") == dk_b.view("uint16")).all()) and bool((dv_a.view("uint16") == dv_b.view("uint16")).all())


@pytest.mark.parametrize("dims", sorted((d, dv) for d, dvs in fa3.FWD_HEADDIM_V.items() for dv in dvs))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_forward_v_head_dim_differs(poison_allocations, dims, causal, dtype):
    """V (and O) of another head dim than Q and K (fa3.FWD_HEADDIM_V: DeepSeek-V3's 192 / 128 and the
    halves), fixed-length with GQA and odd lengths, then packed with an empty sequence; impl="auto" picks
    FA3 for them."""
    import cupy

    d, dv = dims
    rng = np.random.default_rng()
    q, k, _ = _inputs(rng, 2, 239, 113, 6, 2, d, dtype)
    v = cupy.asarray(rng.standard_normal((2, 113, 2, dv), dtype=np.float32)).astype(dtype)
    out, lse = cuflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (2, 239, 6, dv) and out.dtype == q.dtype
    o_ref, lse_ref = ref.attention_ref(q, k, v, causal=causal)
    o_low, _ = ref.attention_ref_lowp(q, k, v, causal=causal)
    ref.check_close("out", out, o_ref, o_low)
    ref.check_close("lse", lse, lse_ref, lse_ref, atol=2e-3)

    lens_q, lens_k = [37, 0, 130], [64, 9, 0]
    qp, kp, _, cu_q, cu_k, hq, hk = varlen_batch(rng, lens_q, lens_k, 6, 2, d, dtype)
    vp = cupy.asarray(rng.standard_normal((kp.shape[0], 2, dv), dtype=np.float32)).astype(dtype)
    out, lse = cuflash.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                              return_lse=True, impl="fa3")
    assert out.shape == (qp.shape[0], 6, dv)
    check_varlen_forward(out, lse, qp, kp, vp, hq, hk, causal=causal)
