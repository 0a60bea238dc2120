"""FP8 family: quantisation of attention inputs to e4m3 with per-block scales and an optional Hadamard rotation.

Public: ``cuflash.fp8.quantize`` and ``cuflash.fp8.hadamard_signs``. The kernel is kernels_cu/fp8/quantize.cu
(sm_89 and newer: it converts with ``cvt.rn.satfinite.e4m3x2.f32``); its top comment describes the work
split. ``cuflash.reference.fp8_quantize`` is the NumPy reference. ``cuflash.flash_attn_func`` takes its
output (``fp8_format="e4m3"`` and the descales; cuflash/fp8_attention.py).
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from . import _validate
from ._interop import Call
from ._jit import Variant, launch
from ._params import DTYPE_CODES, pointer_fields

FAMILY = "fp8"
HEADDIMS = (64, 128, 256)
MIN_CC = (8, 9)  # cvt.rn.satfinite.e4m3x2.f32
THREADS = 256  # 8 warps, one row per warp at a time
TILE_ROWS = 128  # rows of one (batch, head) per CTA tile: FP8_TILE_ROWS in kernels_cu/fp8/params.cuh
FORMATS = ("e4m3",)
FP8_MAX = 448.0  # the largest finite e4m3 value
AMAX_FLOOR = 2.0 ** -100  # the kernel raises a group's (un-normalised) amax to this at least
PASS_FUSED, PASS_AMAX, PASS_CONVERT = 0, 1, 2  # Fp8Pass in kernels_cu/fp8/params.cuh
_MAX_GRID_YZ = 65535  # heads and batch are grid dimensions y and z
_MAX_SEQLEN = 2 ** 30 - 1  # rows stay in int32 arithmetic in the kernel (row + block < 2^31)

# Mirror of Fp8QuantParams in kernels_cu/fp8/params.cuh (same order, C alignment).
PARAMS = np.dtype(
    pointer_fields("x", "data", "descale", "amax")
    + [(f"x_{s}_stride", np.int64) for s in ("batch", "row", "head")]
    + [(n, np.int32) for n in ("batch", "seqlen", "heads", "block", "num_blocks", "tile_groups", "chunks", "pass")]
    + [("sign_key", np.uint32), ("descale_per_amax", np.float32)],
    align=True,
)


# ----------------------------------------------------------------------------------------------------
# the Hadamard signs (the same generator as kernels_cu/fp8/signs.cuh)

_M32 = 0xFFFFFFFF


def _mix32(x):
    """"lowbias32" on uint32 values, as ``mix32`` in kernels_cu/fp8/signs.cuh (the products are taken in
    uint64 and cut to 32 bits: the C code's wrapping uint32 arithmetic, without NumPy overflow warnings)."""
    m = np.uint64(_M32)
    x = np.asarray(x, dtype=np.uint64) & m
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & m
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & m
    x ^= x >> np.uint64(16)
    return x.astype(np.uint32)


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int in [0, 2**64); got {type(seed).__name__}")
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed must be in [0, 2**64); got {seed}")
    return int(seed)


def sign_key(seed: int) -> int:
    """The 32-bit key the kernel hashes with the channel index: mix32(lo ^ mix32(hi + 0x9E3779B9)), lo and
    hi the two 32-bit halves of the seed."""
    seed = _check_seed(seed)
    lo, hi = seed & _M32, seed >> 32
    inner = int(_mix32((hi + 0x9E3779B9) & _M32))
    return int(_mix32(lo ^ inner))


def hadamard_signs(d: int, seed: int = 0) -> np.ndarray:
    """The ±1 vector s (float32, shape (d,)) of the rotation ``quantize(..., hadamard=True, seed=seed)``
    applies: x_rot = x diag(s) H_d / sqrt(d), H_d the Sylvester Hadamard matrix (H_1 = [1],
    H_2n = [[H_n, H_n], [H_n, -H_n]], symmetric, H_d H_d = d I).

    s_i = -1 exactly when bit 31 of mix32(sign_key(seed) ^ i) is set (kernels_cu/fp8/signs.cuh): a
    function of (seed, i) only, so every call, shape and head with the same seed and d uses the same s,
    and the signs of a smaller d are a prefix of a larger d's. To undo the rotation (e.g. of a
    dequantised tensor or of an attention output computed from rotated V): x = (x_rot @ H_d / sqrt(d)) * s,
    which ``cuflash.reference.hadamard_rotate(x_rot, seed, inverse=True)`` computes.
    """
    if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1 or d & (d - 1):
        raise ValueError(f"d must be a power of two >= 1; got {d!r}")
    key = np.uint32(sign_key(seed))
    bits = _mix32(key ^ np.arange(d, dtype=np.uint32)) >> np.uint32(31)
    return np.where(bits == 1, np.float32(-1.0), np.float32(1.0))


def descale_per_amax(d: int, hadamard: bool) -> np.float32:
    """fp32(1 / (448 sqrt(d))) with the rotation (the kernel scales the un-normalised transform), fp32(1 / 448)
    without: descale = max(amax, AMAX_FLOOR) * this, amax taken over the un-normalised values."""
    return np.float32(1.0 / (FP8_MAX * (math.sqrt(d) if hadamard else 1.0)))


# ----------------------------------------------------------------------------------------------------
# variants and tiles


def quantize_variant(headdim: int, dtype: str, hadamard: bool) -> Variant:
    return Variant(FAMILY, "fp8/quantize.cu", "fp8_quantize",
                   (("CUFLASH_HEADDIM", headdim), ("CUFLASH_DTYPE", DTYPE_CODES[dtype]),
                    ("CUFLASH_HADAMARD", int(hadamard))), threads=THREADS)


def _arch_cc(arch: str) -> tuple[int, int]:
    digits = arch.removeprefix("sm_").removeprefix("compute_").rstrip("af")
    return int(digits[:-1]), int(digits[-1])


def all_variants(arch: str) -> list[Variant]:
    """Every variant (2 dtypes x 3 head dims x rotation on/off); none for archs before sm_89."""
    if _arch_cc(arch) < MIN_CC:
        return []
    return [quantize_variant(d, dtype, hadamard) for dtype in DTYPE_CODES for d in HEADDIMS for hadamard in (False, True)]


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """How the kernel's CTA tiles cover a sequence (kernels_cu/fp8/quantize.cu, top comment).

    ``block``: rows per group, clamped to seqlen; ``num_blocks``: groups per (batch, head);
    ``tile_groups``: whole groups per tile (fused pass); ``chunks``: tiles per group (> 1: the two-launch
    AMAX + CONVERT path); ``tiles``: grid.x."""

    block: int
    num_blocks: int
    tile_groups: int
    chunks: int
    tiles: int

    @property
    def split(self) -> bool:
        return self.chunks > 1


def tile_plan(seqlen: int, block: int | None) -> TilePlan:
    blk = seqlen if block is None else min(int(block), seqlen)
    nblk = -(-seqlen // blk)
    if blk <= TILE_ROWS:
        tile_groups = TILE_ROWS // blk
        return TilePlan(blk, nblk, tile_groups, 1, -(-nblk // tile_groups))
    chunks = -(-blk // TILE_ROWS)
    return TilePlan(blk, nblk, 1, chunks, nblk * chunks)


def tile_rows(plan: TilePlan, seqlen: int, tile: int) -> tuple[int, int, int, int]:
    """(first group, groups, row_begin, row_end) of CTA tile ``tile``: the kernel's arithmetic, for tests."""
    if not plan.split:
        first = tile * plan.tile_groups
        groups = min(plan.tile_groups, plan.num_blocks - first)
        begin = first * plan.block
        return first, groups, begin, min(seqlen, begin + groups * plan.block)
    first, chunk = divmod(tile, plan.chunks)
    begin = first * plan.block + chunk * TILE_ROWS
    return first, 1, begin, min(seqlen, (first + 1) * plan.block, begin + TILE_ROWS)


def launch_quantize(x, data, descale, amax, plan: TilePlan, hadamard: bool, seed: int, stream) -> None:
    """Quantise the CuPy array ``x`` into ``data`` / ``descale``. ``amax``: a zeroed uint32 (batch, heads,
    num_blocks) scratch when ``plan.split``, else None."""
    b, s, h, d = x.shape
    item = x.dtype.itemsize
    p = np.zeros(1, PARAMS)
    p["x"], p["data"], p["descale"] = x.data.ptr, data.data.ptr, descale.data.ptr
    p["amax"] = 0 if amax is None else amax.data.ptr
    for axis, name in enumerate(("batch", "row", "head")):
        p[f"x_{name}_stride"] = x.strides[axis] // item
    p["batch"], p["seqlen"], p["heads"] = b, s, h
    p["block"], p["num_blocks"], p["tile_groups"], p["chunks"] = plan.block, plan.num_blocks, plan.tile_groups, plan.chunks
    p["sign_key"] = sign_key(seed)
    p["descale_per_amax"] = descale_per_amax(d, hadamard)
    variant = quantize_variant(d, str(x.dtype), hadamard)
    grid = (plan.tiles, h, b)
    if plan.split:
        p["pass"] = PASS_AMAX
        launch(variant, grid, (p,), stream)
        p2 = p.copy()
        p2["pass"] = PASS_CONVERT
        launch(variant, grid, (p2,), stream)
    else:
        p["pass"] = PASS_FUSED
        launch(variant, grid, (p,), stream)


# ----------------------------------------------------------------------------------------------------
# the public function


def _check_block(block) -> int | None:
    if block is None:
        return None
    if isinstance(block, bool) or not isinstance(block, numbers.Integral):
        raise TypeError("block must be an int >= 1 (rows of the sequence per scale) or None (one scale per "
                        f"(batch, head)); got {type(block).__name__}")
    if block < 1:
        raise ValueError(f"block must be >= 1 (rows of the sequence per scale) or None; got {block}")
    return int(block)


#: The rows per scale ``quantize`` takes by default: 256, a whole key tile of every FP8 forward variant (d = 128
#: with rows of 2k and more runs on 256-key tiles, which need one K and one V descale per tile:
#: cuflash.heuristics.FA3_FP8_TILES_WIDE; blocks of 128 take 128-key tiles, ~10 % slower there).
DEFAULT_BLOCK = 256


def quantize(x, *, block=DEFAULT_BLOCK, hadamard=True, seed=0, fp8_format="e4m3"):
    """Quantise ``x`` to FP8 e4m3 with one scale per block of rows, optionally rotating each row first.

    ``x``: (batch, seqlen, heads, d) float16 or bfloat16, d in {64, 128, 256}; a CuPy array or any DLPack
    GPU array (torch, JAX); the last dimension contiguous, the other strides free (multiples of 8
    elements, 16-byte aligned start, as everywhere in cuflash). Needs an sm_89 or newer GPU.

    Returns ``(data, descale)`` in the caller's framework, computed on its current stream:

    * ``data``: uint8 (batch, seqlen, heads, d), contiguous: the bit patterns of OCP float8_e4m3fn values
      (``data.view(torch.float8_e4m3fn)``, ``data.view(ml_dtypes.float8_e4m3fn)``);
    * ``descale``: float32 (batch, heads, ceil(seqlen / block)), contiguous: x_rot ≈ fp8(data) * descale for
      every row of the block (rows j * block .. (j + 1) * block - 1 of that batch entry and head).

    ``block``: rows of the sequence per scale (int >= 1; 1 = one scale per token); ``None``: one scale per
    (batch, head) over the whole sequence (descale (batch, heads, 1)). The scale is
    descale = amax / 448 with amax = max |x_rot| over the group (448: the largest finite e4m3), so the
    largest element maps to ±448; the conversion rounds to nearest even and saturates to ±448. A group
    of zeros gets descale 1 and data 0. Groups whose amax is below about 1e-31 (bf16 only) get the scale
    of that floor. Non-finite inputs: NaN elements are left out of the amax and come out as e4m3 NaN
    (with the rotation a NaN spreads to its whole row); an infinite element makes its group's descale
    inf and its data 0 or NaN. Do not feed non-finite values.

    ``hadamard=True``: before scaling, each row (head-dim vector) is multiplied by diag(s) and by the
    normalised Sylvester Hadamard matrix H_d / sqrt(d), s = ±1 a function of ``seed`` and the channel
    (``hadamard_signs(d, seed)``). The rotation is orthogonal, so dot products between rows rotated with
    the same seed are unchanged: (q D H)(k D H)^T = q k^T. It spreads outlier channels over the whole
    row, which shrinks the quantisation error of the scores q·k when a few channels are large. Use:

    1. apply RoPE to q and k first (the rotation must come after RoPE, which mixes channel pairs;
       rotating afterwards preserves the q·k of the RoPE'd vectors);
    2. quantise q and k with ``hadamard=True`` and the same ``seed``;
    3. quantise v with ``hadamard=False`` -- unless the caller un-rotates the attention output
       (out_rot @ H_d / sqrt(d) * s, see ``hadamard_signs``).

    Scores are then softmax_scale * (fp8(q_data) fp8(k_data)^T) * q_descale[row block] * k_descale[key
    block]: pass ``data`` and ``descale`` to ``cuflash.flash_attn_func(..., q_descale=, k_descale=, v_descale=,
    fp8_format="e4m3", descale_block=(q block, k/v block))``. ``fp8_format``: "e4m3" only
    (OCP float8_e4m3fn). Bad arguments raise ValueError/TypeError naming the argument before any kernel
    runs. The rotation is computed in fp32 as a fast Walsh-Hadamard transform;
    ``cuflash.reference.fp8_quantize`` is the NumPy reference.
    """
    import cupy

    from . import _device

    if fp8_format not in FORMATS:
        raise ValueError(f"fp8_format must be one of {FORMATS} (OCP float8_e4m3fn); got {fp8_format!r}")
    block = _check_block(block)
    if not isinstance(hadamard, bool):
        raise TypeError(f"hadamard must be a bool; got {type(hadamard).__name__}")
    seed = _check_seed(seed)
    with Call([("x", x)]) as call:
        (spec,) = call.specs
        _validate.check_layout(spec)
        batch, seqlen, heads, d = spec.shape
        if d not in HEADDIMS:
            raise ValueError(f"x's head dim must be one of {list(HEADDIMS)} for cuflash.fp8.quantize; got {d}")
        if min(batch, seqlen, heads) < 1:
            raise ValueError(f"x must have at least one batch entry, one row and one head; got shape {spec.shape}")
        for what, n, limit in (("batch", batch, _MAX_GRID_YZ), ("heads", heads, _MAX_GRID_YZ),
                               ("seqlen", seqlen, _MAX_SEQLEN)):
            if n > limit:
                raise ValueError(f"x's {what} must be at most {limit} (grid and int32 limits); got shape {spec.shape}")
        cc = _device.compute_capability(call.device.id)
        if cc < MIN_CC:
            raise ValueError(f"cuflash.fp8.quantize needs sm_{MIN_CC[0]}{MIN_CC[1]} or newer (the e4m3 conversion "
                             f"instruction); x is on an sm_{cc[0]}{cc[1]} GPU (device {call.device.id})")
        plan = tile_plan(seqlen, block)
        data = cupy.empty((batch, seqlen, heads, d), dtype=cupy.uint8)
        descale = cupy.empty((batch, heads, plan.num_blocks), dtype=cupy.float32)
        amax = cupy.zeros((batch, heads, plan.num_blocks), dtype=cupy.uint32) if plan.split else None
        launch_quantize(call.arrays[0], data, descale, amax, plan, hadamard, seed, call.stream)
        return call.wrap(data), call.wrap(descale)
