"""Decode family on the GPU (flash_attn_with_kvcache, flash_attn_combine) against the fp32 reference by
FlashAttention's tolerance rule; every allocation poisoned with NaN (conftest.poison_allocations), so an
output element the kernels never write fails. Covers contiguous and paged caches (page sizes 1, 16, 64,
256), ragged cache lengths with 0 and 1, the in-place append, rotary (GPT-NeoX and GPT-J, partial
rotary_dim), seqlen_q > 1 causal (bottom-right, rows that see nothing), window, softcap, GQA groups
larger than one 16-row block, unsplit / forced / automatic splits, cache_batch_idx, an int cache_seqlens,
check=False, fp16, the combine on its own, and a check=False step with out= / workspace= captured in a CUDA
graph and replayed after new cache lengths are written in place."""
import numpy as np
import pytest

import cuflash
from cuflash import reference as ref
from cuflash.bench import capture_on_stream

pytestmark = pytest.mark.gpu


def _rand(rng, shape, dtype):
    import cupy

    return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def _inputs(rng, *, dtype, paged, page_size, b, sq, h, hkv, d, lens, new, rotary_dim=0, cache_batch=None):
    """q, caches, new k/v, cache_seqlens (int32 on the GPU), page_table and rotary tables as a dict of
    flash_attn_with_kvcache's arguments. Unused page-table entries hold -1 (the kernels must not read them)."""
    import cupy

    need = max(lens) + new
    args = {"q": _rand(rng, (b, sq, h, d), dtype)}
    if paged:
        max_pages = -(-need // page_size) + 1
        pages = b * max_pages + 3
        args["k_cache"] = _rand(rng, (pages, page_size, hkv, d), dtype)
        args["v_cache"] = _rand(rng, (pages, page_size, hkv, d), dtype)
        table = rng.permutation(pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
        for bi, n in enumerate(lens):
            table[bi, -(-(n + new) // page_size):] = -1
        args["page_table"] = cupy.asarray(table)
    else:
        rows = cache_batch or b
        args["k_cache"] = _rand(rng, (rows, need + 5, hkv, d), dtype)
        args["v_cache"] = _rand(rng, (rows, need + 5, hkv, d), dtype)
        if cache_batch:
            args["cache_batch_idx"] = cupy.asarray(rng.permutation(cache_batch)[:b].astype(np.int32))
    if new:
        args["k"] = _rand(rng, (b, new, hkv, d), dtype)
        args["v"] = _rand(rng, (b, new, hkv, d), dtype)
    args["cache_seqlens"] = cupy.asarray(np.asarray(lens, np.int32))
    if rotary_dim:
        pos = np.arange(need + sq + 1)[:, None]
        inv_freq = 1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
        args["rotary_cos"] = cupy.asarray(np.cos(pos * inv_freq).astype(np.float32)).astype(dtype)
        args["rotary_sin"] = cupy.asarray(np.sin(pos * inv_freq).astype(np.float32)).astype(dtype)
    return args


def _run(args, *, num_splits=0, check=True, seqlens_as_int=False, **options):
    """Calls flash_attn_with_kvcache on ``args`` (the caches are modified in place) and checks out, lse and
    both caches against the references computed from copies taken before the call. Returns (out, lse)."""
    kc0, vc0 = args["k_cache"].copy(), args["v_cache"].copy()
    call = dict(args)
    if seqlens_as_int:
        call["cache_seqlens"] = int(args["cache_seqlens"][0])
    q, kc, vc = call.pop("q"), call.pop("k_cache"), call.pop("v_cache")
    k, v = call.pop("k", None), call.pop("v", None)
    out, lse = cuflash.flash_attn_with_kvcache(q, kc, vc, k, v, num_splits=num_splits, check=check,
                                               return_softmax_lse=True, **call, **options)
    ref_args = dict(args, k_cache=kc0, v_cache=vc0)
    o_ref, lse_ref, kc_ref, vc_ref = ref.kvcache_attention_ref(**ref_args, **options)
    o_low, _, _, _ = ref.kvcache_attention_ref(**ref_args, lowp=True, **options)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    ref.check_close("out", out, o_ref, o_low)
    ref.check_close("lse", lse, lse_ref, lse_ref, atol=2e-3)
    # the append: v copied bit for bit, k rotated as rotary_ref rounded (same fp32 products; allow one ulp),
    # every other cache row untouched
    assert bool((vc.view("uint16") == vc_ref.view("uint16")).all()), "v_cache after the append"
    got, want = kc.astype("float32"), kc_ref.astype("float32")
    ulp = 2.0 ** -7 if str(q.dtype) == "bfloat16" else 2.0 ** -10
    assert float(abs(got - want).max() if got.size else 0) <= ulp * float(abs(want).max()), "k_cache after the append"
    if "rotary_cos" not in args:
        assert bool((kc.view("uint16") == kc_ref.view("uint16")).all()), "k_cache after the append"
    return out, lse


CONTIGUOUS = [
    # (b, sq, h, hkv, d, lens, new)
    (3, 1, 8, 2, 128, (0, 1, 337), 1),
    (2, 1, 4, 4, 64, (1, 1000), 0),
    (4, 1, 16, 1, 256, (7, 0, 64, 129), 1),
    (1, 1, 32, 8, 128, (4224,), 1),
    (2, 1, 6, 2, 64, (63, 65), 0),
]


@pytest.mark.parametrize("shape", CONTIGUOUS, ids=[f"b{c[0]}-h{c[2]}-{c[3]}-d{c[4]}-lens{'_'.join(map(str, c[5]))}-new{c[6]}"
                                                   for c in CONTIGUOUS])
@pytest.mark.parametrize("num_splits", [1, 0, 3])
def test_contiguous(poison_allocations, shape, num_splits):
    b, sq, h, hkv, d, lens, new = shape
    args = _inputs(np.random.default_rng(), dtype="bfloat16", paged=False, page_size=0, b=b, sq=sq, h=h, hkv=hkv, d=d,
                   lens=lens, new=new)
    _run(args, num_splits=num_splits)


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_paged(poison_allocations, page_size, num_splits, d):
    args = _inputs(np.random.default_rng(), dtype="bfloat16", paged=True, page_size=page_size, b=4, sq=1, h=8, hkv=2,
                   d=d, lens=(0, 1, 300, 1000), new=1)
    _run(args, num_splits=num_splits)


@pytest.mark.parametrize("copy_chunks", [1, 2, 4])
@pytest.mark.parametrize("page_size", [0, 1, 16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_copy_chunks(poison_allocations, monkeypatch, copy_chunks, page_size, d):
    """The tile copy with each thread taking 1, 2 or 4 chunks of a row (heuristics.DecodeTiles.copy_chunks and
    paged_copy_chunks; scripts/decode_probe.py times them): contiguous and paged, ragged lengths with rows
    past the keys."""
    import dataclasses

    from cuflash import heuristics

    # (cuflash.decode and cuflash.api hold the same dict)
    monkeypatch.setitem(heuristics.DECODE_TILES, d, dataclasses.replace(heuristics.DECODE_TILES[d], copy_chunks=copy_chunks,
                                                                         paged_copy_chunks=copy_chunks))
    args = _inputs(np.random.default_rng(), dtype="bfloat16", paged=page_size > 0, page_size=page_size, b=4, sq=1,
                   h=8, hkv=2, d=d, lens=(0, 1, 300, 1000), new=1)
    _run(args, num_splits=3)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("d", [128, 256])
def test_tiles_for_99_kb_gpus(poison_allocations, monkeypatch, paged, d):
    """The decode tiles of GPUs with 99 KB of shared memory per block (DECODE_TILES_SMALL_SMEM: two
    stages at d = 128, 32-key tiles of two warps at d = 256), run here by telling the call the device has
    that much: ragged lengths, unsplit and split."""
    from cuflash import _device, decode

    monkeypatch.setattr(_device, "max_smem_per_block", lambda device=0: 101376)
    assert decode.fwd_variant(d, "bfloat16", paged, max_smem=101376).smem_bytes + decode.STATIC_SMEM_BOUND <= 101376
    args = _inputs(np.random.default_rng(), dtype="bfloat16", paged=paged, page_size=16, b=3, sq=2, h=8, hkv=2, d=d,
                   lens=(0, 150, 1000), new=1)
    for num_splits in (1, 3):
        _run(args, num_splits=num_splits, causal=True)


def test_shared_memory_beyond_the_device_is_a_clear_error(monkeypatch):
    """A kernel that needs more shared memory per block than the device has is refused with the numbers
    (cuflash._jit), not by a driver error at launch."""
    from cuflash import _device, _jit

    monkeypatch.setattr(_device, "max_smem_per_block", lambda device=0: 48 * 1024)
    monkeypatch.setattr(_jit, "_loaded", {})
    args = _inputs(np.random.default_rng(), dtype="bfloat16", paged=False, page_size=0, b=1, sq=1, h=8, hkv=2, d=256,
                   lens=(100,), new=0)
    with pytest.raises(RuntimeError, match="bytes of shared memory per thread block; this GPU"):
        _run(args, num_splits=1)


@pytest.mark.parametrize("batch", [3, 80])
def test_paged_ring_depth_by_grid(poison_allocations, batch):
    """A paged cache's ring at d = 128 is deeper when the grid has at most one block per SM
    (decode.fwd_stages): 3 entries x 2 KV heads take that variant, 80 x 2 (more blocks than any GPU here
    has SMs) the table's."""
    from cuflash import decode

    assert decode.fwd_stages(128, True, one_wave=True) != decode.fwd_stages(128, True, one_wave=False)
    args = _inputs(np.random.default_rng(), dtype="bfloat16", paged=True, page_size=1, b=batch, sq=1, h=8, hkv=2,
                   d=128, lens=tuple(37 * i % 400 for i in range(batch)), new=1)
    _run(args, num_splits=1)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("sq,new", [(4, 4), (7, 7), (5, 2), (3, 0)])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_causal_several_queries(poison_allocations, paged, sq, new, num_splits):
    """Sq > 1 (speculative decoding, chunked prefill): bottom-right causal within each entry; entry 0 has an
    empty cache, so with Sq > new its first rows see nothing (out 0, lse -inf)."""
    args = _inputs(np.random.default_rng(), dtype="bfloat16", paged=paged, page_size=16, b=3, sq=sq, h=8, hkv=2,
                   d=128, lens=(0, 1, 250), new=new)
    out, lse = _run(args, num_splits=num_splits, causal=True)
    if sq > new:
        assert bool((lse[0, :, : sq - new] == -np.inf).all())
        assert float(abs(out[0, : sq - new].astype("float32")).max()) == 0.0


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotary_dim", [64, 128])
@pytest.mark.parametrize("paged", [False, True])
def test_rotary(poison_allocations, interleaved, causal, rotary_dim, paged):
    """Rotary on q (positions cache_seqlens + i when causal, else cache_seqlens) and on the appended k;
    rotary_dim 64 of d = 128 leaves the upper half as it is."""
    args = _inputs(np.random.default_rng(), dtype="bfloat16", paged=paged, page_size=16, b=3, sq=3, h=8, hkv=2, d=128,
                   lens=(0, 5, 200), new=3, rotary_dim=rotary_dim)
    _run(args, num_splits=0, causal=causal, rotary_interleaved=interleaved)


@pytest.mark.parametrize("window", [(32, 0), (100, -1), (0, 0), (17, 5)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_window(poison_allocations, window, num_splits):
    args = _inputs(np.random.default_rng(), dtype="bfloat16", paged=True, page_size=64, b=3, sq=2, h=8, hkv=2, d=128,
                   lens=(0, 40, 700), new=2)
    _run(args, num_splits=num_splits, window_size=window)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap(poison_allocations, num_splits, causal):
    args = _inputs(np.random.default_rng(), dtype="bfloat16", paged=False, page_size=0, b=2, sq=2, h=8, hkv=2, d=128,
                   lens=(90, 500), new=1)
    args["q"] = (args["q"].astype("float32") * 4).astype("bfloat16")  # large logits, so the cap matters
    _run(args, num_splits=num_splits, causal=causal, softcap=5.0)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp16(poison_allocations, d):
    args = _inputs(np.random.default_rng(), dtype="float16", paged=True, page_size=16, b=2, sq=2, h=4, hkv=2, d=d,
                   lens=(3, 333), new=2, rotary_dim=32)
    _run(args, num_splits=0, causal=True)


@pytest.mark.parametrize("h,hkv,sq", [(32, 1, 1), (8, 2, 5), (48, 4, 3)])
def test_gqa_groups_over_16_rows(poison_allocations, h, hkv, sq):
    """group x seqlen_q > 16 rows: several m-blocks per (entry, KV head)."""
    args = _inputs(np.random.default_rng(), dtype="bfloat16", paged=True, page_size=16, b=2, sq=sq, h=h, hkv=hkv,
                   d=128, lens=(1, 400), new=1)
    _run(args, num_splits=0, causal=True)


def test_cache_batch_idx(poison_allocations):
    args = _inputs(np.random.default_rng(), dtype="bfloat16", paged=False, page_size=0, b=3, sq=1, h=8, hkv=2, d=128,
                   lens=(10, 0, 300), new=1, cache_batch=5)
    _run(args, num_splits=2)


def test_int_cache_seqlens(poison_allocations):
    args = _inputs(np.random.default_rng(), dtype="bfloat16", paged=True, page_size=16, b=3, sq=1, h=8, hkv=2, d=64,
                   lens=(77, 77, 77), new=1)
    _run(args, num_splits=0, seqlens_as_int=True)


def test_unchecked_call_matches(poison_allocations):
    """check=False (the CUDA-graph path) computes the same thing on good inputs."""
    args = _inputs(np.random.default_rng(), dtype="bfloat16", paged=True, page_size=16, b=2, sq=1, h=8, hkv=2, d=128,
                   lens=(5, 900), new=0)
    _run(args, num_splits=4, check=False)


def test_splits_agree(poison_allocations):
    """The same call unsplit, forced into 1..7 splits and automatic: each within tolerance (the partial
    results and the combine are exercised on a long cache at batch 1, where the heuristic splits)."""
    args = _inputs(np.random.default_rng(), dtype="bfloat16", paged=True, page_size=64, b=1, sq=1, h=8, hkv=1, d=128,
                   lens=(8191,), new=0)
    for n in (1, 2, 7, 0):
        _run(args, num_splits=n)


@pytest.mark.parametrize("splits_and_dim", [(6, 96), (40, 256)])
@pytest.mark.parametrize("out_dtype", [None, "bfloat16", "float16"])
def test_combine(poison_allocations, out_dtype, splits_and_dim):
    """flash_attn_combine on its own: random partials, a split with lse -inf whose rows hold NaN (weight 0,
    never multiplied), a row with every split at -inf (out 0, lse -inf), strided (non-contiguous) partials;
    a head dim under one pass of the warp's 128 columns and one over two, split counts under one batch of
    loads (16) and over a warp's 32 lanes (the LSEs read again past it)."""
    import cupy

    rng = np.random.default_rng()
    ns, d = splits_and_dim
    b, s, h = 2, 3, 5
    o_full = rng.standard_normal((ns, b, s, h, d + 8)).astype(np.float32)
    lse = (rng.standard_normal((ns, b, h, s)) * 4).astype(np.float32)
    lse[2] = -np.inf
    o_full[2] = np.nan
    lse[:, 1, 3, 2] = -np.inf
    o = o_full[..., :d]
    o_dev = cupy.asarray(o_full)[..., :d]  # heads d + 8 elements apart: strides are read, not assumed
    assert not o_dev.flags.c_contiguous
    out, l = cuflash.flash_attn_combine(o_dev, cupy.asarray(lse), out_dtype=out_dtype)
    want_o, want_l = ref.combine_ref(o, lse)
    assert out.shape == (b, s, h, d) and str(out.dtype) == (out_dtype or "float32") and l.shape == (b, h, s)
    rtol = {None: 1e-5, "bfloat16": 1e-2, "float16": 2e-3}[out_dtype]
    np.testing.assert_allclose(out.astype("float32").get(), want_o, rtol=rtol, atol=1e-5)
    got_l = l.get()
    assert np.array_equal(got_l == -np.inf, want_l == -np.inf)
    fin = np.isfinite(want_l)
    np.testing.assert_allclose(got_l[fin], want_l[fin], rtol=1e-5, atol=1e-5)
    assert float(abs(out[1, 2, 3].astype("float32")).max()) == 0.0


def test_combine_of_split_decode_matches_unsplit(poison_allocations):
    """The public combine merges what cuflash's own split results would be: two halves of the keys
    attended separately (as two caches), merged, against attention over all keys."""
    import cupy

    rng = np.random.default_rng()
    b, h, hkv, d, n = 2, 8, 2, 128, 500
    q = _rand(rng, (b, 1, h, d), "bfloat16")
    kc, vc = _rand(rng, (b, n, hkv, d), "bfloat16"), _rand(rng, (b, n, hkv, d), "bfloat16")
    parts = []
    for lo, hi in ((0, 217), (217, n)):
        o, l = cuflash.flash_attn_with_kvcache(q, cupy.ascontiguousarray(kc[:, lo:hi]), cupy.ascontiguousarray(vc[:, lo:hi]),
                                               cache_seqlens=hi - lo, num_splits=1, return_softmax_lse=True)
        parts.append((o.astype("float32"), l))
    out, lse = cuflash.flash_attn_combine(cupy.stack([p[0] for p in parts]), cupy.stack([p[1] for p in parts]),
                                          out_dtype="bfloat16")
    o_ref, lse_ref, _, _ = ref.kvcache_attention_ref(q, kc, vc, cache_seqlens=n)
    o_low, _, _, _ = ref.kvcache_attention_ref(q, kc, vc, cache_seqlens=n, lowp=True)
    ref.check_close("out", out, o_ref, o_low)
    ref.check_close("lse", lse, lse_ref, lse_ref, atol=2e-3)


# ----------------------------------------------------------------------------------------------------
# CUDA graphs: a check=False decode step with out= and workspace= captured once, replayed after new
# cache_seqlens (and new q / k / v) are written in place
# ----------------------------------------------------------------------------------------------------

def _refuse_allocation(size):
    raise AssertionError(f"flash_attn_with_kvcache allocated {size} bytes with out= and workspace= given")


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("forced_splits", [0, 1, 5])
def test_graph_capture_and_replay(poison_allocations, paged, forced_splits):
    """Capture (CuPy stream capture) a decode step that appends one token and attends, with caller-owned
    out and workspace: the capture allocates nothing (an allocator that raises is installed during it)
    and reads nothing on the host (check=False). Then, for new cache lengths (including 0) and new q/k/v
    written in place, each replay must equal an eager call bit for bit (same kernels, same split count)
    and the fp32 reference by FlashAttention's rule. ``out`` is poisoned (NaN) before each replay.
    With several splits (5, and the heuristic's count: 8 on a 132-SM GPU) the combine is captured as the
    split kernel's programmatic dependent on sm_90+ (a programmatic edge of the graph)."""
    import cupy

    rng = np.random.default_rng()
    b, h, hkv, d, new = 3, 8, 2, 128, 1
    lens0 = (5, 300, 1000)
    trials = [lens0, (0, 17, 1500), (64, 1, 2040)]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        args = _inputs(rng, dtype="bfloat16", paged=paged, page_size=16, b=b, sq=1, h=h, hkv=hkv, d=d,
                       lens=(0, 0, max(max(t) for t in trials)), new=new)
        if paged:  # every entry may grow to the longest trial: give each its pages (a permutation)
            pages = args["k_cache"].shape[0]
            per = args["page_table"].shape[1]
            args["page_table"] = cupy.asarray(rng.permutation(pages)[: b * per].reshape(b, per).astype(np.int32))
            capacity = per * 16
        else:
            capacity = args["k_cache"].shape[1]
        seqlens = cupy.asarray(np.asarray(lens0, np.int32))
        q, kc, vc, k, v = args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"]
        pt = args.get("page_table")
        splits = forced_splits or cuflash.api.kvcache_num_splits(b, h, hkv, 1, d, capacity, paged=paged)
        out = cupy.empty_like(q)
        ws = cupy.empty(cuflash.api.kvcache_workspace_bytes(b, h, 1, d, splits), dtype=cupy.uint8)

        def step():
            return cuflash.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, page_table=pt,
                                                   num_splits=forced_splits, check=False, out=out, workspace=ws,
                                                   return_softmax_lse=True)

        step()  # compile and load outside the capture
        stream.synchronize()
        with cupy.cuda.using_allocator(_refuse_allocation):
            graph, (out_g, lse_g) = capture_on_stream(stream, step)
        assert out_g is out and not stream.is_capturing()

        for trial, lens in enumerate(trials):
            if trial:  # new values in place: the graph holds pointers, not values
                seqlens[...] = cupy.asarray(np.asarray(lens, np.int32))
                q[...] = _rand(rng, q.shape, "bfloat16")
                k[...] = _rand(rng, k.shape, "bfloat16")
                v[...] = _rand(rng, v.shape, "bfloat16")
            kc0, vc0 = kc.copy(), vc.copy()
            out.view(cupy.uint16).fill(0xFFFF)  # NaN: an element the replay does not write fails below
            graph.launch(stream)
            got_o, got_l = out.copy(), lse_g.copy()
            kc1, vc1 = kc.copy(), vc.copy()
            # eager, checked, same split count: appends the same k/v again (the same bytes) and attends
            want_o, want_l = cuflash.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, page_table=pt,
                                                             num_splits=splits, return_softmax_lse=True)
            stream.synchronize()
            assert bool((got_o.view("uint16") == want_o.view("uint16")).all()), f"trial {trial}: out differs"
            assert bool(((got_l == want_l) | (cupy.isnan(got_l) & cupy.isnan(want_l))).all()), f"trial {trial}: lse"
            assert bool((kc1.view("uint16") == kc.view("uint16")).all()), f"trial {trial}: append not idempotent"
            ref_args = dict(q=q, k_cache=kc0, v_cache=vc0, k=k, v=v, cache_seqlens=seqlens)
            if pt is not None:
                ref_args["page_table"] = pt
            o_ref, lse_ref, kc_ref, vc_ref = ref.kvcache_attention_ref(**ref_args)
            o_low, _, _, _ = ref.kvcache_attention_ref(**ref_args, lowp=True)
            ref.check_close("out", got_o, o_ref, o_low)
            ref.check_close("lse", got_l, lse_ref, lse_ref, atol=2e-3)
            assert bool((vc1.view("uint16") == vc_ref.view("uint16")).all()), f"trial {trial}: v_cache after replay"


def test_checked_call_refused_during_capture():
    """check=True copies cache_seqlens to the host; during capture CuPy refuses that copy with a RuntimeError
    before issuing it, so the capture stays usable and the stream works afterwards."""
    import cupy

    rng = np.random.default_rng()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        args = _inputs(rng, dtype="bfloat16", paged=False, page_size=0, b=2, sq=1, h=8, hkv=2, d=128, lens=(3, 90),
                       new=0)
        call = dict(args)
        q, kc, vc = call.pop("q"), call.pop("k_cache"), call.pop("v_cache")
        cuflash.flash_attn_with_kvcache(q, kc, vc, **call)
        stream.synchronize()
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="captur"):
                cuflash.flash_attn_with_kvcache(q, kc, vc, **call)
        finally:
            try:
                stream.end_capture()
            except Exception:  # noqa: BLE001 - only the capture state matters below
                pass
        assert not stream.is_capturing()
        _run(args, num_splits=0)  # usable afterwards


PLAN_CASES = [  # (paged, new tokens, rotary_dim, num_splits, return lse)
    (False, 0, 0, 0, False), (False, 1, 0, 1, True), (True, 0, 0, 0, True), (True, 2, 64, 5, False),
    (False, 3, 128, 0, True),
]


@pytest.mark.parametrize("paged, new, rotary_dim, num_splits, with_lse", PLAN_CASES)
def test_plan_runs_match_the_call(poison_allocations, paged, new, rotary_dim, num_splits, with_lse):
    """A plan made on one set of arrays, run on another of the same layout at other addresses and with other
    contents (cache lengths, tokens, pages), gives what flash_attn_with_kvcache (same split count) gives on
    a copy of that set, bit for bit: out, lse and both caches after the append. (Every set's longest entry
    is the same, so the caches and page tables have one shape.)"""
    import cupy

    rng = np.random.default_rng()
    shape = dict(dtype="bfloat16", paged=paged, page_size=16, b=3, sq=2 if new else 1, h=8, hkv=2, d=128,
                 new=new, rotary_dim=rotary_dim)
    planned = _inputs(rng, lens=(40, 700, 1500), **shape)
    options = dict(causal=bool(new), num_splits=num_splits)
    out_p = cupy.empty_like(planned["q"])
    plan = cuflash.plan_kvcache(**planned, **options, return_softmax_lse=with_lse, out=out_p)
    for lens in ((0, 33, 1500), (1500, 1, 640)):  # (the longest sets the caches' and page table's sizes)
        fresh = _inputs(rng, lens=lens, **shape)
        twin = {n: a.copy() for n, a in fresh.items()}
        out = cupy.empty_like(fresh["q"])
        got = plan.run(**fresh, out=out)
        got_o, got_l = got if with_lse else (got, None)
        assert got_o is out
        splits = num_splits or cuflash.api.kvcache_num_splits(3, 8, 2, shape["sq"], 128,
                                                              planned["k_cache"].shape[1] * (
                                                                  planned["page_table"].shape[1] if paged else 1),
                                                              paged=paged, page_size=16 if paged else None)
        assert plan.num_splits == splits
        want_o, want_l = cuflash.flash_attn_with_kvcache(**twin, causal=bool(new), num_splits=splits,
                                                         return_softmax_lse=True)
        cupy.cuda.get_current_stream().synchronize()
        assert bool((got_o.view("uint16") == want_o.view("uint16")).all()), f"{lens}: out"
        if with_lse:
            assert bool(((got_l == want_l) | (cupy.isnan(got_l) & cupy.isnan(want_l))).all()), f"{lens}: lse"
        for c in ("k_cache", "v_cache"):
            assert bool((fresh[c].view("uint16") == twin[c].view("uint16")).all()), f"{lens}: {c} after the append"


def test_plan_run_in_a_graph_and_with_torch(poison_allocations):
    """plan.run captured in a CUDA graph (nothing allocated during the capture) replays with new cache
    lengths written in place like an eager call; a plan made on torch tensors runs on torch's current
    stream and takes torch tensors."""
    import cupy

    rng = np.random.default_rng()
    args = _inputs(rng, dtype="bfloat16", paged=False, page_size=0, b=2, sq=1, h=8, hkv=2, d=128,
                   lens=(100, 2000), new=1)
    out = cupy.empty_like(args["q"])
    plan = cuflash.plan_kvcache(**args, out=out)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plan.run(**args, out=out)
        stream.synchronize()
        with cupy.cuda.using_allocator(_refuse_allocation):
            graph, _ = capture_on_stream(stream, lambda: plan.run(**args, out=out))
        args["cache_seqlens"][...] = cupy.asarray(np.asarray([7, 1500], np.int32))
        graph.launch(stream)
        got = out.copy()
        want = cuflash.flash_attn_with_kvcache(**args, num_splits=plan.num_splits)  # appends the same token again
        stream.synchronize()
    assert bool((got.view("uint16") == want.view("uint16")).all())
    torch = pytest.importorskip("torch")
    targs = {n: torch.from_dlpack(a) for n, a in args.items()}
    tout = torch.empty_like(targs["q"])
    tplan = cuflash.plan_kvcache(**targs, out=tout)
    assert tplan.run(**targs, out=tout) is tout
    torch.cuda.synchronize()
    want = cuflash.flash_attn_with_kvcache(**args, num_splits=tplan.num_splits)
    cupy.cuda.get_current_stream().synchronize()
    assert bool((cupy.from_dlpack(tout).view("uint16") == want.view("uint16")).all())
    with pytest.raises(ValueError, match="q must have the planned"):
        tplan.run(**dict(targs, q=targs["q"].float()), out=tout)
