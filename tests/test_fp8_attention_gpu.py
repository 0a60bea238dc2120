"""GPU tier of FP8 attention: ``flash_attn_func`` on e4m3 inputs (FA3's FP8 kernel, ``fa3.forward_fp8``).

Inputs: N(0, 1) bf16 q, k, v quantised by ``cuflash.fp8.quantize`` -- q and k rotated with one seed (their
dot products are unchanged), v not -- with the descales per block or per tensor. Every CuPy allocation
starts as NaN bytes (``poison_allocations``), so an output element the kernel does not write fails.

Tolerance. The reference, ``reference.attention_fp8_ref``, runs in fp64 on the same bytes and descales, so
the quantisation of the inputs is not part of the difference; what is left is the kernel's own arithmetic:

  (a) the scores: products of e4m3 values are exact, their sums go through the FP8 tensor cores'
      accumulator, which drops low bits as it adds them (about 14 bits kept: the DeepSeek-V3 report) by an
      amount that follows the running sum. ``reference.fp8_score_error_units`` models what
      test_score_error_within_bound measures: (d / 32 + 1) 2^-14 scale sum_i |q_i k_i| for a random key
      (~1.5e-3 at d = 64, ~8e-3 at d = 256 here, more with a larger softmax scale), plus (d / 4) 2^-14 scale
      |sum_i q_i k_i|, which matters for a key aligned with its query (a dominant "needle": the row's LSE
      moves with its score); softmax turns a score error e into a relative weight error e, and an error
      common to a row's dominant keys moves its LSE, not its weights;
  (b) P rounded to e4m3 for the PV product: up to 2^-4 relative per element (3 mantissa bits), the
      largest term, averaged over the keys of a row;
  (c) the output rounded to bf16: 2^-9 relative.

The model -- ``attention_fp8_ref(..., round_p=True)``, which rounds exp(s - max) to e4m3 before the
product with V, rounded to bf16 -- has (b) and (c). By FlashAttention's rule the kernel may be at most
twice as wrong as that model, plus atol for (a), which the model leaves out: 1e-2, or twice the bound
(``reference.fp8_score_error_bound``; for O without the aligned keys' term) where that is larger.
The kernel rounds P against the running row maximum rather than the final one, which moves where the
roundings fall but not their size: the factor 2 covers that. The LSE does not see (b) or (c); it is
1-Lipschitz in the scores, so (a) bounds it: the same atol. (A fuzz case with scale 0.27 at d = 256,
about 4x the default, moved the LSE by 1.03e-2 against a bound of 2.8e-2.)

The accuracy test of issue 9 (point 4) compares with an fp64 reference on the unquantised inputs
instead and prints the RMSE of block scaling + Hadamard and of per-tensor scaling without rotation
(``pytest -s`` shows the numbers).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cuflash
from cuflash import api, fa3, fp8, heuristics
from cuflash import reference as ref
from gpu_checks import inputs, rising_maxima_inputs, with_exp2_emu

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_allocations")]

ATOL = 1e-2  # out and LSE (the module docstring derives it)
SEED = 7  # the Hadamard signs' seed, the same for q and k


@pytest.fixture(autouse=True)
def _needs_hopper():
    from cuflash._device import compute_capability, has_gpu

    if not has_gpu():
        pytest.skip("no CUDA GPU")
    why = api._supports_arch(fa3, compute_capability())
    if why is not None:
        pytest.skip(f"FP8 attention runs on FA3's Hopper kernel: {why}")


def quantised(q, k, v, q_block, k_block, v_block):
    """(q, k, v) e4m3 bytes and (q, k, v) descales from cuflash.fp8.quantize; block None: one scale per
    (batch, head)."""
    qd, qs = fp8.quantize(q, block=q_block, hadamard=True, seed=SEED)
    kd, ks = fp8.quantize(k, block=k_block, hadamard=True, seed=SEED)
    vd, vs = fp8.quantize(v, block=v_block, hadamard=False)
    return (qd, kd, vd), (qs, ks, vs)


def descale_block(q_block, k_block, v_block):
    """The descale_block argument for these quantiser blocks (a per-tensor descale ignores its entry)."""
    return (q_block or 128, k_block or v_block or 128)


def check(data, descales, blocks, causal, out=None, lse=None):
    """The kernel's (out, lse) -- computed here unless given -- against the fp64 reference of the same bytes."""
    if out is None:
        out, lse = cuflash.flash_attn_func(*data, q_descale=descales[0], k_descale=descales[1],
                                           v_descale=descales[2], fp8_format="e4m3", descale_block=blocks,
                                           causal=causal, return_lse=True)
    b, sq, h, d = data[0].shape
    assert str(out.dtype).endswith("bfloat16") and tuple(out.shape) == (b, sq, h, d)
    assert str(lse.dtype).endswith("float32") and tuple(lse.shape) == (b, h, sq)
    ref.check_fp8_attention("fp8", out, lse, data, descales, descale_block=blocks, causal=causal, atol=ATOL)


SEQLENS = [(1, 1), (113, 239), (239, 113), (1023, 1023), (1, 1023), (1023, 1)]


@pytest.mark.parametrize("seqlens", SEQLENS, ids=[f"sq{a}-sk{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_forward(d, causal, seqlens):
    sq, sk = seqlens
    q, k, v = inputs(np.random.default_rng(), 2, sq, sk, 4, 2, d, "bfloat16")
    data, descales = quantised(q, k, v, 128, 128, 128)
    check(data, descales, (128, 128), causal)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_score_error_within_bound(d):
    """With one key a row's LSE is its scaled score, so the kernel's LSE minus the fp64 score is the FP8
    tensor cores' accumulation error alone, which ``reference.fp8_score_error_bound`` bounds (per row here:
    ``fp8_score_error_units``). Half the rows get a key that is a multiple of their query -- every product
    positive, the running sum as large as it gets at each step: the worst case for an accumulator that drops
    low bits; the bound's second term -- the other half a random key (the first term alone). Prints the
    largest error in units of scale sum_i |q_i k_i| 2^-14 and as a share of the bound (``pytest -s``)."""
    import cupy

    rng = np.random.default_rng()
    b, h = 512, 8
    q = rng.standard_normal((b, 1, h, d)).astype(np.float32)
    k = rng.standard_normal((b, 1, h, d)).astype(np.float32)
    needle = np.arange(b) % 2 == 0
    k[needle] = q[needle] * rng.uniform(0.5, 3.0, size=(int(needle.sum()), 1, h, 1)).astype(np.float32)
    v = rng.standard_normal((b, 1, h, d)).astype(np.float32)
    q, k, v = (cupy.asarray(x).astype("bfloat16") for x in (q, k, v))
    data, descales = quantised(q, k, v, None, None, None)
    _, lse = cuflash.flash_attn_func(*data, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                                     fp8_format="e4m3", return_lse=True)
    qf = ref._dequantize_e4m3(data[0], descales[0], 1, np.dtype("float64"))[:, 0]  # (b, h, d)
    kf = ref._dequantize_e4m3(data[1], descales[1], 1, np.dtype("float64"))[:, 0]
    scale = 1.0 / np.sqrt(d)
    dot, abs_dot = (qf * kf).sum(-1), cupy.abs(qf * kf).sum(-1)  # (b, h)
    err = cupy.abs(lse[:, :, 0].astype(cupy.float64) - scale * dot) / (scale * 2.0**-14)
    allowed = {"random": ref.fp8_score_error_units(d, abs_dot), "needle": ref.fp8_score_error_units(d, abs_dot, dot)}
    for kind, rows in (("needle", needle), ("random", ~needle)):
        rows = cupy.asarray(rows)
        worst = float((err / abs_dot)[rows].max())
        share = float((err / allowed[kind])[rows].max())
        print(f"d = {d}, {kind} keys: FP8 score error up to {worst:.2f} units of scale sum|q k| 2^-14, "
              f"{share:.2f} of the bound")
        assert share <= 1.0, f"d = {d}, {kind} keys: FP8 score error {worst:.2f} units, {share:.2f}x the bound"


@pytest.mark.parametrize("emu", [4, 2])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_forward_exponentials_on_the_fma_pipe(monkeypatch, emu, d, causal):
    """The FP8 softmax with a quarter (emu = 4) or half (2) of its exponentials through poly_exp2 (the
    variants scripts/fa3_exp2_probe.py --precompile-only compiles)."""
    with_exp2_emu(monkeypatch, emu)
    q, k, v = inputs(np.random.default_rng(), 2, 1023, 239, 4, 2, d, "bfloat16")
    data, descales = quantised(q, k, v, 128, 128, 128)
    check(data, descales, (128, 128), causal)


@pytest.mark.parametrize("seqlens", [(239, 1023), (1023, 239)], ids=["sq239-sk1023", "sq1023-sk239"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_gqa_mqa(kv_heads, causal, seqlens):
    sq, sk = seqlens
    q, k, v = inputs(np.random.default_rng(), 2, sq, sk, 8, kv_heads, 128, "bfloat16")
    data, descales = quantised(q, k, v, 128, 128, 128)
    check(data, descales, (128, 128), causal)


BLOCKS = [
    # (q block, k block, v block) of the quantiser; None: one scale per (batch, head)
    (128, 128, 128), (64, 128, 128), (64, 256, 256), (128, 256, 256), (1, 128, 128),
    (None, None, None), (64, None, None), (None, 256, None), (128, None, 128),
]


@pytest.mark.parametrize("blocks", BLOCKS, ids=["q{}-k{}-v{}".format(*b) for b in BLOCKS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_descale_blocks(causal, blocks):
    q, k, v = inputs(np.random.default_rng(), 2, 239, 1023, 4, 2, 128, "bfloat16")
    data, descales = quantised(q, k, v, *blocks)
    check(data, descales, descale_block(*blocks), causal)


SEQLENS_256 = [(1, 1), (113, 239), (239, 513), (1023, 1023), (1, 1023), (1023, 1), (300, 2000)]
BLOCKS_256 = [(128, 256, 256), (64, 512, 512), (None, None, None), (128, None, 256)]


@pytest.mark.parametrize("blocks", BLOCKS_256, ids=["q{}-k{}-v{}".format(*b) for b in BLOCKS_256])
@pytest.mark.parametrize("seqlens", SEQLENS_256, ids=[f"sq{a}-sk{b}" for a, b in SEQLENS_256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_forward_256_key_tiles(monkeypatch, d, causal, seqlens, blocks):
    """FA3_FP8_TILES_WIDE's tiles at every length, on K / V descale blocks of 256 and 512 keys and per tensor:
    d = 64 and 128 on 256 keys (two V^T atoms per tile, no intra-warpgroup overlap), d = 256 on 128 with the
    overlap and P through shared memory (fwd.cu P_SMEM)."""
    monkeypatch.setattr(heuristics, "FA3_FP8_LONG_MIN_SEQLEN", 1)
    tiles = fa3.fwd_tiles(d, fp8=True, long_rows=True)
    assert tiles.block_n == 256 or tiles.p_smem
    sq, sk = seqlens
    q, k, v = inputs(np.random.default_rng(), 2, sq, sk, 8, 2, d, "bfloat16")
    data, descales = quantised(q, k, v, *blocks)
    check(data, descales, descale_block(*blocks), causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_forward_256_key_tiles_on_blocks_of_very_different_scales(monkeypatch, d, causal):
    """FA3_FP8_TILES_WIDE's tiles (d = 256: P_SMEM's) on V descales 100x apart from block to block (O moves
    between their units) and K descales 9x apart (the row maxima kept in logit units)."""
    import cupy

    monkeypatch.setattr(heuristics, "FA3_FP8_LONG_MIN_SEQLEN", 1)
    q, k, v = inputs(np.random.default_rng(), 2, 700, 1500, 4, 2, d, "bfloat16")
    block = np.arange(1500) // 256  # the key's descale block

    def scaled(x, factors):
        return (x.astype(cupy.float32) * cupy.asarray(factors, dtype=cupy.float32)[None, :, None, None]).astype(x.dtype)

    v = scaled(v, 10.0 ** (block % 3 - 1))  # 0.1, 1, 10, 0.1, ...
    k = scaled(k, 3.0 ** ((block + 1) % 3 - 1))  # 1, 3, 1/3, 1, ...
    data, descales = quantised(q, k, v, 128, 256, 256)
    check(data, descales, (128, 256), causal)


@pytest.mark.parametrize("speculative", [False, True], ids=["after-max", "speculative"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_256_key_tiles_where_row_maxima_rise(monkeypatch, causal, speculative):
    """Row maxima that rise past 2^8 after a row's first tile, where the speculative max (fwd.cu
    SPECULATIVE_MAX: exponentials from the running max) must recompute S: keys 256-511 scaled 4x and the rest
    16x (every row's max rises more than 2^8-fold twice, then holds), and one late key that only the first 16
    query rows of each Q block (one warp of a consumer) align with, so one warp's vote makes its warpgroup
    redo the tile."""
    monkeypatch.setattr(heuristics, "FA3_FP8_LONG_MIN_SEQLEN", 1)
    wide = heuristics.FA3_FP8_TILES_WIDE[128]
    monkeypatch.setitem(heuristics.FA3_FP8_TILES_WIDE, 128, dataclasses.replace(wide, speculative_max=speculative))
    q, k, v = rising_maxima_inputs(np.random.default_rng(), 700, 2000, 256, 1900)
    data, descales = quantised(q, k, v, 128, 256, 256)
    check(data, descales, (128, 256), causal)


@pytest.mark.parametrize("speculative", [False, True], ids=["after-max", "speculative"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_d64_where_row_maxima_rise(monkeypatch, causal, speculative):
    """d = 64's tiles (heuristics.FA3_FP8_TILES), after the max and speculative, on the rising maxima above, with descale
    blocks of 128 keys (the tiles' width): keys 128-255 scaled 4x, the rest 16x, one late key aligned with
    one warp's rows, so tiles with the S overlap in flight redo their exponentials."""
    tiles = heuristics.FA3_FP8_TILES[64]
    monkeypatch.setitem(heuristics.FA3_FP8_TILES, 64, dataclasses.replace(tiles, speculative_max=speculative))
    q, k, v = rising_maxima_inputs(np.random.default_rng(), 700, 1500, 128, 1400, d=64)
    data, descales = quantised(q, k, v, 128, 128, 128)
    check(data, descales, (128, 128), causal)


def test_fuzz_seed_909998490_within_the_tolerance():
    """The fuzz case that the speculative max at d = 64 failed (heuristics.FA3_FP8_TILES: rows keeping an old
    max round P on another grid than the reference's model; 6.95e-2 against 4.83e-2 allowed): 3 x 128 x 512,
    GQA 8 / 4, per-tensor descales, K and V sliced from longer sequences."""
    import test_fuzz_gpu  # (tests/ is on the path, as for gpu_checks)

    seed = 909998490
    cfg = test_fuzz_gpu.draw_config(seed)
    q, k, v, _, _ = test_fuzz_gpu.make_inputs(cfg, np.random.default_rng([seed, 1]))
    test_fuzz_gpu.run_fp8_case(cfg, q, k, v)


def test_strided_inputs_and_descales():
    """Every other head of quantised q, k, v (strided views) with the matching, non-contiguous descales."""
    q, k, v = inputs(np.random.default_rng(), 2, 239, 400, 8, 4, 128, "bfloat16")
    (qd, kd, vd), (qs, ks, vs) = quantised(q, k, v, 64, 128, 128)
    data = (qd[:, :, ::2], kd[:, :, ::2], vd[:, :, ::2])
    assert not data[0].flags.c_contiguous
    check(data, (qs[:, ::2], ks[:, ::2], vs[:, ::2]), (64, 128), True)


def test_torch_float8_e4m3fn_inputs():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA")
    import cupy

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((2, n, hh, 128), generator=gen, device="cuda", dtype=torch.bfloat16)
               for n, hh in ((239, 8), (1023, 2), (1023, 2)))
    data, descales = quantised(q, k, v, 128, 128, 128)
    f8 = [x.view(torch.float8_e4m3fn) for x in data]
    out, lse = cuflash.flash_attn_func(*f8, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                                       descale_block=(128, 128), causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and isinstance(lse, torch.Tensor)
    torch.cuda.synchronize()
    check([cupy.from_dlpack(x) for x in data], [cupy.from_dlpack(x) for x in descales], (128, 128), True,
          out=cupy.from_dlpack(out), lse=cupy.from_dlpack(lse))


def test_per_tensor_descale_of_one_is_the_default():
    """None means 1.0: a call without descales equals one with descales of ones."""
    import cupy

    q, k, v = inputs(np.random.default_rng(), 1, 113, 239, 4, 4, 64, "bfloat16")
    (qd, kd, vd), _ = quantised(q, k, v, None, None, None)
    ones = cupy.ones((1, 4, 1), cupy.float32)
    plain = cuflash.flash_attn_func(qd, kd, vd, fp8_format="e4m3")
    given = cuflash.flash_attn_func(qd, kd, vd, fp8_format="e4m3", q_descale=ones, k_descale=ones, v_descale=ones)
    assert bool(cupy.array_equal(plain.view(cupy.uint16), given.view(cupy.uint16)))


def dominant_key_inputs(d, sq, sk, h):
    """bf16 q (1, sq, h, d), k and v (1, sk, 1, d) from N(0, 1), with key 5 + (i, head) parallel to query i of
    that head and 4x as long: each row's weight almost all on that one key near the start."""
    q, k, v = inputs(np.random.default_rng(d), 1, sq, sk, h, 1, d, "bfloat16")
    for i in range(sq):
        for head in range(h):
            k[0, 5 + i * h + head, 0] = (q[0, i, head].astype("float32") * 4).astype(k.dtype)
    return q, k, v


@pytest.mark.parametrize("per_tensor", [False, True], ids=["block128", "per-tensor"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_a_dominant_key_keeps_its_weight_over_a_long_row(d, per_tensor):
    """Each query row's weight sits almost all on one key near the start of 2^20 keys (8,192 K tiles after
    it), so O is that key's V row. FP8 wgmma keeps about 14 bits of the accumulator it adds to: an O carried
    through every P V GEMM lost ~40 % of that row here (per-block V descales, which rescale O at every
    tile) before each tile's P V got a fresh accumulator added to O in fp32 (kernels_cu/fa3/fwd.cu). The
    usual fp64 check of the same bytes fails on a few per cent. tests/test_large_gpu.py does the same at 2^22 keys."""
    q, k, v = dominant_key_inputs(d, 3, 1 << 20, 2)
    block = None if per_tensor else 128
    data, descales = quantised(q, k, v, block, block, block)
    blocks = descale_block(block, block, block)
    out, lse = cuflash.flash_attn_func(*data, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                                       fp8_format="e4m3", descale_block=blocks, return_lse=True)
    o_ref, lse_ref = ref.attention_fp8_ref(*data, *descales, descale_block=blocks)
    o_model, _ = ref.attention_fp8_ref(*data, *descales, descale_block=blocks, round_p=True)
    ref.check_close("fp8 out", out, o_ref, ref._round_to(o_model, "bfloat16"), atol=ATOL)
    # The LSE is the dominant key's score (~40), which the tensor cores' accumulator moves with it (session 7
    # measured 1.5e-2 at d = 64): the aligned keys' bound.
    lse_atol = max(ATOL, 2 * ref.fp8_score_error_bound(*data[:2], *descales[:2], descale_block=blocks))
    ref.check_close("fp8 lse", lse, lse_ref, lse_ref, atol=lse_atol)


@pytest.mark.parametrize("many_keys", [False, True], ids=["at-the-limit", "past-it"])
def test_a_dominant_key_keeps_its_weight_on_the_p_smem_tiles(monkeypatch, many_keys):
    """d = 256's P_SMEM tiles keep O in the FP8 wgmma's accumulator, which loses ~2^-15 of O at every V
    descale block: the longest rows they take (FA3_FP8_P_SMEM_MAX_SEQLEN_K keys, blocks of 256) must still
    hold a dominant key's weight within the FP8 bound, and one key more takes the fresh accumulator (its
    2^20-key row: test_a_dominant_key_keeps_its_weight_over_a_long_row)."""
    monkeypatch.setattr(heuristics, "FA3_FP8_LONG_MIN_SEQLEN", 1)
    sk = heuristics.FA3_FP8_P_SMEM_MAX_SEQLEN_K + many_keys
    d, sq, h = 256, 3, 2
    dims = fa3.Dims(1, sq, sk, h, 1, d, "bfloat16")
    assert fa3.fwd_tiles(d, fp8=True, **fa3.fp8_call_kind(dims, 256)).p_smem != many_keys
    q, k, v = dominant_key_inputs(d, sq, sk, h)
    data, descales = quantised(q, k, v, 256, 256, 256)
    out = cuflash.flash_attn_func(*data, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                                  fp8_format="e4m3", descale_block=(256, 256))
    o_ref, _ = ref.attention_fp8_ref(*data, *descales, descale_block=(256, 256))
    o_model, _ = ref.attention_fp8_ref(*data, *descales, descale_block=(256, 256), round_p=True)
    ref.check_close("fp8 out", out, o_ref, ref._round_to(o_model, "bfloat16"), atol=ATOL)


# ----------------------------------------------------------------------------------------------------
# accuracy on inputs with outliers (issue 9, point 4)
# ----------------------------------------------------------------------------------------------------

FA3_BLOCK_HADAMARD_RMSE = 9.1e-3  # FlashAttention-3's figure for block quantisation + incoherent processing
PER_TENSOR_LOOSE_BOUND = 0.1  # FA3 measured 2.4e-2; this only catches a broken path


def outlier_input(rng, shape):
    """N(0, 1) with 0.1 % of the entries given an extra N(0, 10^2), in bf16 on the GPU."""
    import cupy

    x = rng.standard_normal(shape)
    hit = rng.random(shape) < 1e-3
    x[hit] += rng.standard_normal(int(hit.sum())) * 10
    return cupy.asarray(x.astype(np.float32)).astype("bfloat16")


@pytest.mark.parametrize("d", [128, 256])
def test_accuracy_with_outliers(d):
    """RMSE of the output against fp64 attention of the unquantised inputs (the bf16 tensors the quantiser
    reads): block scaling (128 and 256) with the Hadamard rotation of q and k within FA3's 9.1e-3; per-tensor
    scaling without rotation reported, and only loosely bounded."""
    import cupy

    rng = np.random.default_rng(d)
    b, s, h = 2, 2048, 8
    q, k, v = (outlier_input(rng, (b, s, h, d)) for _ in range(3))
    want, _ = ref.attention_ref(q, k, v, compute_dtype="float64")

    def rmse(out):
        return float(cupy.sqrt(cupy.mean((out.astype(cupy.float64) - want) ** 2)))

    def fp8_rmse(block, hadamard):
        qd, qs = fp8.quantize(q, block=block, hadamard=hadamard, seed=SEED)
        kd, ks = fp8.quantize(k, block=block, hadamard=hadamard, seed=SEED)
        vd, vs = fp8.quantize(v, block=block, hadamard=False)
        out = cuflash.flash_attn_func(qd, kd, vd, q_descale=qs, k_descale=ks, v_descale=vs, fp8_format="e4m3",
                                      descale_block=(block or 128, block or 128))
        return rmse(out)

    block_hadamard = fp8_rmse(128, True)
    block_256_hadamard = fp8_rmse(256, True)  # (d = 128: the 256-key tiles, heuristics.FA3_FP8_TILES_WIDE)
    per_tensor = fp8_rmse(None, False)
    bf16 = rmse(cuflash.flash_attn_func(q, k, v))
    print(f"\nFP8 attention RMSE vs fp64, d={d}, batch {b}, seqlen {s}, heads {h}, N(0,1) + 0.1% N(0,10^2) outliers: "
          f"block 128 + Hadamard {block_hadamard:.2e}; block 256 + Hadamard {block_256_hadamard:.2e}; per tensor, "
          f"no rotation {per_tensor:.2e}; bf16 flash_attn_func {bf16:.2e}")
    assert block_hadamard <= FA3_BLOCK_HADAMARD_RMSE and block_256_hadamard <= FA3_BLOCK_HADAMARD_RMSE
    assert per_tensor <= PER_TENSOR_LOOSE_BOUND
