"""Interleaved A/B timing of kernel configurations, for the questions bench/NOTES.md asks next. Each
experiment times its configurations in rounds (the order rotating each round) and its first configuration
once more at the end of every round (an A/A pair: the spread between the two is the noise), then prints the
median TF/s per configuration with the [slowest-fastest] round. Timing back to back in one fixed order
misleads on the H200: under load the clocks fall with the power cap (~690 W) within a second, so whatever
runs first looks fastest (session 10).

Experiments (FlashAttention benchmark shapes: 16k tokens, hidden 2048):
  fp8-d128   FP8 forward d = 128 N = 8k: the tiles of the table (FA3_FP8_TILES_LONG[128]), and without
             the intra-warpgroup overlap (P V completes before the next S is issued: d = 256's arrangement,
             which reached 1016-1059 TF/s there), with and without the pingpong; the row maxima in 4 FMNMX
             chains (CUFLASH_MAX_CHAINS 4). Session 11 measured three stages, the pingpong switched and
             exp2_emu 8 / 4 too: none beat the table.
  fp8-wide-pingpong  FP8 forward d = 128 N = 2k, 8k, 16k, causal and not, descales per 256: the 256-key tiles
             (FA3_FP8_TILES_WIDE) with the pingpong against without, and without with the turn fence
             (fwd.cu CUFLASH_TURN_FENCE); d = 64 / 256 8k: their WIDE tiles with and without the fence
  fp8-d128-keys  FP8 forward d = 128 N = 8k and 16k, causal and not, K / V descales per 256 keys: the
             128-key tiles of FA3_FP8_TILES_LONG (intra-warpgroup overlap, no pingpong) against the 256-key
             tiles of FA3_FP8_TILES_WIDE (no overlap, pingpong)
  fp8-d128-blocks  FP8 forward d = 128 N = 8k: the 256-key tiles on K / V descales per 256 keys and per
             tensor, the 128-key tiles on blocks of 128 and 256
  fp8-d128-spec  FP8 forward d = 128 N = 2k, 8k, 16k, causal and not, 256-key tiles: the softmax's
             exponentials after each tile's max against from the running max (SPECULATIVE_MAX)
  fp8-spec-long  FP8 forward d = 64 and 128 on K / V descale blocks of 128 (intra-warpgroup overlap), N = 2k
             and 8k, causal and not: the plain step against the speculative max
  fp8-d64-wide  FP8 forward d = 64 N = 2k and 8k, causal and not, on K / V descale blocks of 256: the 128-key
             tiles of FA3_FP8_TILES against FA3_FP8_TILES_WIDE's 256-key ones, and 256-key tiles with the
             overlap and the pingpong (48 bytes spilled under NVRTC 13.0)
  fp8-scaling  FP8 forward d = 128 N = 8k on descales per 128-row block and per tensor (what the per-block
             V descale's O rescale at every tile costs)
  fp8-d64    FP8 forward d = 64 N = 8k, causal and not: the table's tiles, with the pingpong switched (session
             11: off lost 2 %), with 4 max chains (three consumer warpgroups spill ~100 bytes in FP8)
  bf16-pingpong  FA3 forward bf16 d = 64 / 128 / 256, N = 2k and 8k, causal and not: the tables' tiles,
             and the same with the pingpong switched (FP8 d = 128 gained 3 % without it, session 10;
             d = 256's 80-key tiles spill 40 bytes without it under NVRTC 13.0: that column is pessimistic)
  bwd-dq     FA3 backward d = 64 and 128 N = 8k: as built, and without the dQ reduce-adds
             (CUFLASH_PROBE_NO_DQ_ADD: what they cost; dQ is wrong then)
  bwd-det    FA3 backward d = 64, 128 and 256, N = 2k and 8k, causal and not: the default against the
             deterministic mode (issue 5: within 15 %)
  bwd-det-cost  FA3 backward d = 128 and 256, N = 2k and 8k, causal and not: where the deterministic mode's time
             goes (the default launched highest first; deterministic without waiting for turns)
  bwd-det-heads  FA3 backward d = 256, N = 8k, causal and not: deterministic against the default with 1, 2, 4
             and 16 heads in the grid (one head: every K block in one wave, the turns a chain of hand-offs),
             with the dQ accumulator planes of fa3.bwd_dq_accumulators and with one plane
  bwd-rows   FA3 backward d = 64, N = 2k ... 16k, causal and not: the rows per step of
             heuristics.FA3_BWD_BLOCK_M against 80 and 64
  bwd-dkv    FA3 backward d = 64, 128 and 256, N = 2k and 8k, causal and not: dK / dV stored by TMA through
             shared memory (as built) against from registers (CUFLASH_STORE_DKV_TMA=0)
  bwd-split-sdp FA3 backward d = 256, N = 2k and 8k, causal and not: bwd_wide.cu's S^T / P^T on consumer 0
             and dP^T / dS^T on consumer 1 (as built) against both on each for half the queries
  fwd-spec   FA3 forward bf16 d = 64, 128, 256, N = 2k and 8k, causal and not: the tables' tiles with the
             softmax's exponentials after each tile's max against from the running max (SPECULATIVE_MAX)
  fwd-spec-d128  the same at d = 128, N = 2k and 4k
  fwd-d64    FA3 forward bf16 d = 64, causal N = 1k, 2k, 4k and non-causal 2k, 8k (causal 2k 0.94 of cuDNN):
             the table's tiles (three consumer warpgroups from causal 2k) against two warpgroups, and the
             three-warpgroup tiles without pingpong, with 3 stages, without the intra-warpgroup overlap,
             with a quarter of the exponentials on the FMA pipe, and the row maxima in 4 FMNMX chains
  fwd-tail   FA3 forward bf16 d = 64, 128, 256, N = 2k, 4k, 8k, not causal: the stream-K tail (the last round's
             tiles split over the keys, tile_order.tail_split) against none
  fwd-d128-stages  FA3 forward bf16 d = 128, N = 2k, 4k, 8k, causal and not: two K / V stages with the O
             staging for a TMA store (the table) against three stages (O stored from registers)
  fwd-d128-overlap  FA3 forward bf16 d = 128, N = 2k, 4k, 8k, causal and not: the table against no overlap
             within a warpgroup with the pingpong (cuDNN's arrangement) and without either
  fwd-row-shift  FA3 forward bf16 causal d = 64 N = 2k, 4k, 8k and d = 128 2k: the spare rows of a length
             that is no multiple of the tile before row 0 (tile_order.row_shift, as built) against after the
             end; d = 64 1k: two warpgroups (tabled) against three, shifted and not
  fwd-short  FA3 forward bf16 d = 64 and 128, N = 512 and 1k, causal and not (issue 4's cells below 0.9 of cuDNN):
             the tables against the pingpong switched, and at d = 64 two consumer warpgroups
  fwd-q-stages  FA3 forward bf16 d = 64 and 128, N = 512, 1k (and 2k), causal and not: the tables against one Q
             buffer and two (Fa3Tiles.q_stages: the next tile's Q and first K / V load while this tile runs)
  fwd-tail-short  FA3 forward bf16 d = 64, 128, 256, N = 2k, not causal: the table's rule (no stream-K tail at 2k)
             against the tail wherever the model gains (FA3_TAIL_MIN_GAIN 0)
  fwd-d128-div  FA3 forward bf16 d = 128, N = 512, 2k, 4k, 8k, 16k, causal and not: the tile order as tabled
             (the host's FastDivmods below FA3_LONG_MIN_SEQLEN rows, plain division from there: Fa3Tiles.
             fast_tile_div) against FastDivmods and plain division at every length
  fwd-idle-wg  FA3 forward bf16 d = 64 (three consumer warpgroups), N = 512 ... 4k: warpgroups with no row of the
             sequence sitting their tiles out (fwd.cu IDLE_WG_SKIP, as built) against computing them
  bwd-row-shift  FA3 backward d = 64 and 128, N = 2k and 4k, causal and not: the spare rows of the last Q
             block before row 0 (tile_order.bwd_row_shift, as built) against none (non-causal takes no
             shift: an A/A check)
  fwd-order  FA3 forward bf16 d = 64, 128 and 256, N = 512, 1k, 2k, 4k and 8k, causal: the tile order the host's
             model chooses (cuflash/tile_order.py) against the kernel's rule before session 16 (one section
             of every pair with the serpentine where the pairs are fewer than half the grid)

    python scripts/ab_probe.py [fp8-d128] [fp8-d128-keys] [fp8-d128-blocks] [fp8-d128-spec] [fp8-spec-long] [fp8-d64-wide] [fp8-wide-pingpong] [fp8-d64] [bf16-pingpong] [bwd-dq] [bwd-det] [bwd-det-cost] [bwd-det-heads] [bwd-rows] [bwd-dkv]
        [bwd-split-sdp] [bwd-row-shift] [fwd-spec] [fwd-order] [fwd-d64] [fwd-tail] [fwd-d128-stages] [fwd-d128-overlap] [fwd-row-shift] [fwd-short] [fwd-idle-wg] [fwd-d128-div] [fwd-tail-short] [fwd-q-stages] [--rounds 5] [--reps 10]
    python scripts/ab_probe.py --list-variants    # (cache_pack.py) the variants beyond the tables
"""
import argparse
import dataclasses
import statistics
from contextlib import ExitStack, contextmanager

import cupy

import cuflash
from cuflash import _validate, fa3, heuristics, tile_order


@contextmanager
def tables_edited(tables, edit):
    """``edit(table)`` applied to each of ``tables`` (dicts the package reads when it plans a call's layout),
    undone after; the plans made under either are forgotten."""
    saved = [dict(t) for t in tables]
    for table in tables:
        edit(table)
    cuflash.clear_plans()
    try:
        yield
    finally:
        for table, old in zip(tables, saved):
            table.clear()
            table.update(old)
        cuflash.clear_plans()


def fp8_tiles(d, tiles):
    """FP8 calls at head dim d take ``tiles`` whatever their length and descale blocks (every table
    fa3.fwd_tiles reads)."""
    return tables_edited((heuristics.FA3_FP8_TILES, heuristics.FA3_FP8_TILES_LONG, heuristics.FA3_FP8_TILES_WIDE),
                         lambda table: table.update({d: tiles}))


def fp8_configs(d):
    """The FP8 experiments' switches at head dim d, from the tiles its long rows take."""
    base = heuristics.FA3_FP8_TILES_LONG.get(d, heuristics.FA3_FP8_TILES[d])
    with_ = lambda **kw: lambda: fp8_tiles(d, dataclasses.replace(base, **kw))  # noqa: E731
    chains = lambda: defines_added("fwd_variant", *MAX_CHAINS_4)  # noqa: E731
    if d == 64:  # (without the overlap, P V takes O's columns in parts of BN: d = 64 has fewer than BN = 128)
        return {"table": lambda: fp8_tiles(d, base), "pingpong switched": with_(pingpong=not base.pingpong),
                "4 max chains": chains}
    return {  # name -> a new context manager per use (a generator's runs once)
        "table": lambda: fp8_tiles(d, base),
        "no overlap, pingpong": with_(intra_wg_overlap=False, pingpong=True),
        "no overlap, no pingpong": with_(intra_wg_overlap=False, pingpong=False),
        "4 max chains": chains,
    }


@contextmanager
def defines_added(builder: str, *defines):
    """Variants from fa3.<builder> (fwd_variant, bwd_variant) get ``defines`` too: fa3 looks the builder up
    when it plans a call's layout (the plans made under either are forgotten)."""
    built = getattr(fa3, builder)

    def variant(*args, **kwargs):
        v = built(*args, **kwargs)
        return dataclasses.replace(v, defines=v.defines + defines)

    setattr(fa3, builder, variant)
    cuflash.clear_plans()
    try:
        yield
    finally:
        setattr(fa3, builder, built)
        cuflash.clear_plans()


def bwd_defines(*defines):
    return defines_added("bwd_variant", *defines)


MAX_CHAINS_4 = (("CUFLASH_MAX_CHAINS", 4),)


def pingpong_switched(d):
    """bf16 FA3 forward calls at head dim d take their tiles with the pingpong switched."""
    def switch(table):
        if d in table:
            table[d] = dataclasses.replace(table[d], pingpong=not table[d].pingpong)

    return tables_edited((heuristics.FA3_TILES, heuristics.FA3_TILES_UNMASKED, heuristics.FA3_TILES_3WG), switch)


@contextmanager
def as_is():
    yield


BF16_HEADDIMS = (64, 128, 256)
NO_DQ_ADD = (("CUFLASH_PROBE_NO_DQ_ADD", 1),)
DKV_FROM_REGISTERS = (("CUFLASH_STORE_DKV_TMA", 0),)
SDP_PER_CONSUMER = (("CUFLASH_SPLIT_SDP", 0),)


def list_variants() -> list:
    """Every variant the experiments compile that the package's tables do not have."""
    out = []
    for d in (64, 128):
        for config in fp8_configs(d).values():
            with config():  # (the experiments' calls have 8k rows and 128-key descale blocks: the long-row tiles)
                out.append(fa3.fwd_variant(d, "bfloat16", fp8=True, long_rows=True, kv_block=fa3.FP8_BLOCK_N))
    fp8_wide = fp8_speculative(128, heuristics.FA3_FP8_TILES_WIDE[128])
    for config in (list(fp8_keys_configs().values()) + list(fp8_wide.values())
                   + list(fp8_wide_pingpong_configs().values())):
        for unmasked in (False, True):
            with config():
                out.append(fa3.fwd_variant(128, "bfloat16", fp8=True, unmasked=unmasked, long_rows=True,
                                           kv_block=256))
    for d in (64, 256):  # fp8_wide_pingpong's
        for config in fp8_fence_configs(d).values():
            for unmasked in (False, True):
                with config():
                    out.append(fa3.fwd_variant(d, "bfloat16", fp8=True, unmasked=unmasked, long_rows=True,
                                               kv_block=256))
    for config in fp8_d64_wide_configs().values():
        with config():
            out.append(fa3.fwd_variant(64, "bfloat16", fp8=True, long_rows=True, kv_block=256))
    # fp8-p-smem's and fp8-p-smem-decay's, fp8-d128-p-smem's, fp8-3wg's (fp8_tiles: whatever the rows and blocks)
    for d, configs in ([(d, fp8_p_smem_configs(d)) for d in (64, 128, 256)] + [(128, fp8_d128_p_smem_configs())]
                       + [(d, fp8_3wg_configs(d)) for d in (64, 128)]):
        for config in configs.values():
            for unmasked in (False, True):
                with config():
                    out.append(fa3.fwd_variant(d, "bfloat16", fp8=True, unmasked=unmasked, long_rows=True, kv_block=256))
    for d in (64, 128):  # fp8-spec-long's
        for config in fp8_speculative(d, fp8_long_tiles(d)).values():
            for unmasked in (False, True):
                with config():
                    out.append(fa3.fwd_variant(d, "bfloat16", fp8=True, unmasked=unmasked, long_rows=True,
                                               kv_block=128))
    with bwd_defines(*NO_DQ_ADD):
        out += [fa3.bwd_variant(d, "bfloat16", block_m=fa3.bwd_block_m(d, False)) for d in (64, 128)]
    with bwd_defines(*DKV_FROM_REGISTERS):
        out += [fa3.bwd_variant(d, "bfloat16", block_m=fa3.bwd_block_m(d, False)) for d in (64, 128, 256)]
    out += [fa3.bwd_variant(64, "bfloat16", block_m=bm) for bm in (64, 80)]  # bwd_rows' rows at d = 64
    with bwd_defines(*SDP_PER_CONSUMER):
        out.append(fa3.bwd_variant(256, "bfloat16", block_m=fa3.bwd_block_m(256, False)))
    for defines in DET_COST_DEFINES.values():
        with bwd_defines(*defines):
            out += [fa3.bwd_variant(d, "bfloat16", block_m=fa3.bwd_block_m(d, False)) for d in (128, 256)]
    for d in BF16_HEADDIMS:  # bf16_pingpong's (N = 2k and 8k, causal and not)
        with pingpong_switched(d):
            out += bf16_forward_variants(d, [(n, causal) for n in (2048, 8192) for causal in (False, True)])
    for d in BF16_HEADDIMS:  # fwd_spec's
        for on in (False, True):
            with speculative_max_set(d, on):
                out += bf16_forward_variants(d, SPEC_CASES)
    with speculative_max_set(128, False):  # test_fa3_gpu's test_d128_where_row_maxima_rise (softcap too)
        out += [fa3.fwd_variant(128, "bfloat16", softcap=True, unmasked=unmasked) for unmasked in (False, True)]
    for config in D64.values():  # fwd_d64's
        with config():
            out += bf16_forward_variants(64, D64_CASES)
    with fa3_tiles_at(128, stages=3):  # fwd_d128_stages'
        out += bf16_forward_variants(128, D128_CASES)
    for changes in ({"intra_wg_overlap": False, "pingpong": True}, {"intra_wg_overlap": False, "pingpong": False}):
        with fa3_tiles_at(128, **changes):  # fwd_d128_overlap's
            out += bf16_forward_variants(128, D128_CASES)
    with defines_added("fwd_variant", *IDLE_WG_OFF):  # fwd_idle_wg's
        out += bf16_forward_variants(64, IDLE_CASES)
    for config in (lambda: fa3_tiles_at(128, fast_tile_div=False),
                   lambda: table_row_at(heuristics.FA3_TILES_LONG, 128, fast_tile_div=True)):
        with config():  # fwd_d128_div's
            out += bf16_forward_variants(128, D128_DIV_CASES)
    for d, cases in Q_STAGES_CASES.items():  # fwd_q_stages'
        for q_stages in (1, 2):
            with bf16_rows_at(d, q_stages=q_stages):
                out += bf16_forward_variants(d, cases)
    for d in (64, 128):  # fwd_short's
        for config in fwd_short_configs(d).values():
            with config():
                out += bf16_forward_variants(d, SHORT_CASES)
    return list(dict.fromkeys(out))


def bf16_forward_variants(d, cases):
    """The variants fwd_interleaved's bf16 calls at head dim d take for ``cases`` of (N, causal), as the
    tables stand now."""
    out = []
    for n, causal in cases:
        dims = _validate.Dims(1, n, n, 1, 1, d, "bfloat16")
        window = _validate.window_bounds((-1, -1), causal, dims)
        out.append(fa3.fwd_variant(d, "bfloat16", unmasked=fa3._unmasked(window, dims),
                                   short_masked=fa3._short_masked(window, dims),
                                   long_rows=n >= heuristics.FA3_LONG_MIN_SEQLEN))
    return out


def bench_shape(d, n, count):
    """The FlashAttention benchmark shape at head dim d and length n (16k tokens, hidden 2048): batch, heads
    and ``count`` random bf16 (batch, n, heads, d) arrays."""
    b, h = 16384 // n, 2048 // d
    arrays = [cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32).astype("bfloat16") for _ in range(count)]
    return b, h, arrays


def interleaved(label, configs, call, flops, rounds, reps):
    from cuflash.bench import time_fn

    names = list(configs)
    times = {n: [] for n in names + ["A/A"]}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)] + ["A/A"]
        for n in order:
            with configs[names[0] if n == "A/A" else n]():
                fn = call()
                times[n].append(time_fn(fn, 2, reps))
    cells = []
    for n, ms in times.items():
        tf = sorted(flops / t / 1e9 for t in ms)
        cells.append(f"{n} {statistics.median(tf):5.0f} [{tf[0]:.0f}-{tf[-1]:.0f}]")
    print(f"{label}: " + " | ".join(cells), flush=True)


def fp8_forward(d, rounds, reps):
    import fp8_probe  # scripts/: the FP8 forward called directly, descales per 128-row block

    n = 8192
    b, h = 16384 // n, 2048 // d
    for causal in (False, True) if d == 64 else (False,):
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        interleaved(f"fp8 d={d} N=8k causal={causal}", fp8_configs(d),
                    lambda: fp8_probe.run(b, n, n, h, h, d, causal)[0], flops, rounds, reps)


def fp8_keys_configs():
    # (2 max chains and exp2_emu 8 / 4 on the 256-key tiles made ptxas serialise their wgmma: not measured)
    long, wide = heuristics.FA3_FP8_TILES_LONG[128], heuristics.FA3_FP8_TILES_WIDE[128]
    return {"128 keys": lambda: fp8_tiles(128, long), "256 keys": lambda: fp8_tiles(128, wide)}


def fp8_wide_pingpong_configs():
    """FP8 d = 128's 256-key tiles (FA3_FP8_TILES_WIDE) with and without the pingpong: without, both consumers'
    exponentials reach the SFU at once, as cuDNN's FP8 kernel's MUFU "mio" stalls suggest its do (ncu, session
    30). Without the pingpong ptxas 13.5 serialises the wgmma unless the turn fence is in (the table's since
    session 31); NVRTC 13.0 (the H200's) compiles all three clean."""
    wide = dataclasses.replace(heuristics.FA3_FP8_TILES_WIDE[128], turn_fence=False)
    no_pingpong = dataclasses.replace(wide, pingpong=False)
    return {"table (pingpong)": lambda: fp8_tiles(128, dataclasses.replace(wide, pingpong=True)),
            "no pingpong": lambda: fp8_tiles(128, no_pingpong),
            "no pingpong, turn fence": lambda: fp8_tiles(128, dataclasses.replace(no_pingpong, turn_fence=True))}


def fp8_fence_configs(d):
    """FP8 at head dim d on its WIDE tiles (no pingpong at d = 64 / 256) with and without the turn fence
    (fwd.cu CUFLASH_TURN_FENCE: a compiler fence where a consumer would wait for its turn)."""
    wide = heuristics.FA3_FP8_TILES_WIDE[d]
    return {"table": lambda: fp8_tiles(d, wide),
            "turn fence": lambda: fp8_tiles(d, dataclasses.replace(wide, turn_fence=True))}


def fp8_wide_pingpong(rounds, reps):
    fp8_shapes(128, (2048, 8192, 16384), 256, fp8_wide_pingpong_configs(), rounds, reps, qblock=256)
    for d in (64, 256):
        fp8_shapes(d, (8192,), 256, fp8_fence_configs(d), rounds, reps, qblock=256)


def fp8_speculative(d, tiles):
    """FP8 calls at head dim d take ``tiles`` with the speculative max off and on."""
    return {"after the max": lambda: fp8_tiles(d, dataclasses.replace(tiles, speculative_max=False)),
            "speculative max": lambda: fp8_tiles(d, dataclasses.replace(tiles, speculative_max=True))}


def fp8_long_tiles(d):
    """The tiles FP8 calls with long rows at head dim d take on K / V descale blocks of 128 (d = 128: the
    128-key long-row tiles, which overlap like bf16 d = 128; d = 64: FA3_FP8_TILES)."""
    return heuristics.FA3_FP8_TILES_LONG.get(d, heuristics.FA3_FP8_TILES[d])


def fp8_shapes(d, seqlens, kvblock, configs, rounds, reps, qblock=128):
    """``configs`` interleaved on the FP8 forward at head dim d, each length of ``seqlens``, causal and not,
    Q / K / V descales per ``qblock`` / ``kvblock`` rows."""
    import fp8_probe

    for n in seqlens:
        b, h = 16384 // n, 2048 // d
        for causal in (False, True):
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            interleaved(f"fp8 d={d} N={n} causal={causal} kv block {kvblock}", configs,
                        lambda: fp8_probe.run(b, n, n, h, h, d, causal, qblock=qblock, kvblock=kvblock)[0], flops,
                        rounds, reps)


def fp8_spec(headdims, seqlens, kvblock, tiles_of, rounds, reps):
    """FP8 forward on K / V descales per ``kvblock`` keys, causal and not: the exponentials after each tile's
    max (step) against from the running max (speculate), on ``tiles_of(d)``."""
    for d in headdims:
        fp8_shapes(d, seqlens, kvblock, fp8_speculative(d, tiles_of(d)), rounds, reps)


def fp8_d64_wide_configs():
    wide = heuristics.FA3_FP8_TILES_WIDE[64]
    return {"128-key tiles": lambda: fp8_tiles(64, heuristics.FA3_FP8_TILES[64]),
            "256-key tiles": lambda: fp8_tiles(64, wide),
            "256, overlap + pingpong": lambda: fp8_tiles(64, dataclasses.replace(wide, intra_wg_overlap=True,
                                                                                 pingpong=True))}


def fp8_d64_wide(rounds, reps):
    fp8_shapes(64, (2048, 8192), 256, fp8_d64_wide_configs(), rounds, reps, qblock=256)


def fresh_pv_tiles(d):
    """The tiles FP8 calls with long rows at head dim d take on descale blocks of 256 with each tile's P V in
    a fresh accumulator (those of rows with many keys): d = 64 / 128 on 256 keys, d = 256 on 128."""
    return fa3.fwd_tiles(d, fp8=True, long_rows=True, kv_block=256, many_keys=True)


def p_smem_tiles(d):
    """fresh_pv_tiles(d) with the overlap and P through shared memory instead (fwd.cu P_SMEM)."""
    return dataclasses.replace(fresh_pv_tiles(d), intra_wg_overlap=True, p_smem=True)


def fp8_p_smem_configs(d):
    tiles = p_smem_tiles(d)
    return {"fresh P V": lambda: fp8_tiles(d, fresh_pv_tiles(d)),
            "P smem, pingpong": lambda: fp8_tiles(d, dataclasses.replace(tiles, pingpong=True)),
            "P smem, no pingpong": lambda: fp8_tiles(d, dataclasses.replace(tiles, pingpong=False))}


def fp8_checked_shapes(d, configs_of, checks, rounds, reps):
    """Each config of ``configs_of(d)``'s error on ``checks`` ((b, sq, sk, h, hkv, causal) calls; fp8_probe.check:
    max |out - ref| of the same bytes, K / V blocks of 256), then fp8_shapes over N = 2k, 8k, 16k."""
    import fp8_probe

    for name, config in configs_of(d).items():
        with config():
            for b, sq, sk, h, hkv, causal in checks:
                print(f"[{name}]", end=" ", flush=True)
                fp8_probe.check(b, sq, sk, h, hkv, d, causal, kvblock=256)
    fp8_shapes(d, (2048, 8192, 16384), 256, configs_of(d), rounds, reps, qblock=256)


def fp8_p_smem(rounds, reps):
    """FP8 forward, descale blocks of 256, d = 128 / 256 / 64: the fresh-accumulator tiles against the overlap
    with P through shared memory and O accumulated by the wgmma (P_SMEM), with and without the pingpong."""
    for d in (128, 256, 64):
        fp8_checked_shapes(d, fp8_p_smem_configs, ((1, 2051, 2100, 2, 2, True), (2, 2048, 2304, 2, 1, False)),
                           rounds, reps)


def fp8_p_smem_decay(rounds, reps):
    """O's decay through the tensor cores' accumulation (fwd.cu P_SMEM) against the row's length: each query
    row's weight almost all on one key near the start of sk keys (test_fp8_attention_gpu's
    test_a_dominant_key_keeps_its_weight_over_a_long_row), descale blocks of 256 (O rescaled every tile by
    the V ratio) and per tensor; max |out - ref| / max |ref| of the fresh-accumulator tiles and of P_SMEM's."""
    import cupy
    import numpy as np

    import cuflash
    from cuflash import fp8, reference

    for d in (128, 64, 256):
        for sk in (8192, 32768, 131072, 1 << 20):
            rng = np.random.default_rng(d)
            sq, h = 3, 2
            q, k, v = (cupy.asarray(rng.standard_normal(s, dtype=np.float32)).astype("bfloat16")
                       for s in ((1, sq, h, d), (1, sk, 1, d), (1, sk, 1, d)))
            for i in range(sq):
                for head in range(h):
                    k[0, 5 + i * h + head, 0] = (q[0, i, head].astype("float32") * 4).astype(k.dtype)
            for block in (256, None):
                qd, qs = fp8.quantize(q, block=block, hadamard=True, seed=7)
                kd, ks = fp8.quantize(k, block=block, hadamard=True, seed=7)
                vd, vs = fp8.quantize(v, block=block, hadamard=False)
                blocks = (block or 128, block or 128)
                o_ref, _ = reference.attention_fp8_ref(qd, kd, vd, qs, ks, vs, descale_block=blocks)
                o_ref = cupy.asnumpy(cupy.asarray(o_ref)).astype(np.float64)
                cells = []
                for name, tiles in (("fresh P V", fresh_pv_tiles(d)), ("P smem", p_smem_tiles(d))):
                    with fp8_tiles(d, tiles):
                        out = cuflash.flash_attn_func(qd, kd, vd, q_descale=qs, k_descale=ks, v_descale=vs,
                                                      fp8_format="e4m3", descale_block=blocks)
                    o = cupy.asnumpy(out.astype(cupy.float32)).astype(np.float64)
                    cells.append(f"{name} {np.abs(o - o_ref).max() / np.abs(o_ref).max():.2e}")
                print(f"decay d={d} sk={sk} block={block}: " + " | ".join(cells), flush=True)


def fp8_d128_p_smem_configs():
    """FP8 d = 128's 256-key tiles (the table's) against P_SMEM's overlap without the pingpong (level with the
    table in fp8-p-smem) and what its spare registers allow: the speculative max (with and without the
    pingpong) and one column group in 8 or 4 of exponentials on the FMA pipe."""
    tiles = dataclasses.replace(p_smem_tiles(128), pingpong=False)
    return {"table": lambda: fp8_tiles(128, heuristics.FA3_FP8_TILES_WIDE[128]),
            "P smem": lambda: fp8_tiles(128, tiles),
            "P smem spec": lambda: fp8_tiles(128, dataclasses.replace(tiles, speculative_max=True)),
            "P smem spec pp": lambda: fp8_tiles(128, dataclasses.replace(tiles, speculative_max=True, pingpong=True)),
            "P smem emu 8": lambda: fp8_tiles(128, dataclasses.replace(tiles, exp2_emu=8)),
            "P smem emu 4": lambda: fp8_tiles(128, dataclasses.replace(tiles, exp2_emu=4))}


def fp8_d128_p_smem(rounds, reps):
    fp8_shapes(128, (2048, 8192, 16384), 256, fp8_d128_p_smem_configs(), rounds, reps, qblock=256)


def fp8_3wg_configs(d):
    """FA3_FP8_TILES_WIDE's tiles at head dim d against three consumer warpgroups (192 query rows, 160
    registers each) on 128-key tiles with the overlap and P through shared memory (S 64 + O 64 registers at
    d = 128), with and without the pingpong, and (d = 128) three stages."""
    tiles = heuristics.Fa3Tiles(block_n=128, stages=2, consumers=3, intra_wg_overlap=True, p_smem=True)
    configs = {"table": lambda: fp8_tiles(d, heuristics.FA3_FP8_TILES_WIDE[d]),
               "3wg P smem, pingpong": lambda: fp8_tiles(d, tiles),
               "3wg P smem, no pingpong": lambda: fp8_tiles(d, dataclasses.replace(tiles, pingpong=False))}
    if d == 128:
        configs["3wg P smem, no pingpong, 3 stages"] = lambda: fp8_tiles(
            d, dataclasses.replace(tiles, pingpong=False, stages=3))
    return configs


def fp8_3wg(rounds, reps):
    """FP8 forward, descale blocks of 256, d = 128 / 64: fp8_3wg_configs."""
    for d in (128, 64):
        fp8_checked_shapes(d, fp8_3wg_configs, ((1, 2051, 2100, 2, 1, True), (1, 2048, 2304, 2, 1, False)),
                           rounds, reps)


def fp8_keys(rounds, reps):
    fp8_shapes(128, (8192, 16384), 256, fp8_keys_configs(), rounds, reps)


def fp8_keys_blocks(rounds, reps):
    """FA3_FP8_TILES_WIDE's 256-key tiles on K / V descale blocks of 256 and per tensor, FA3_FP8_TILES_LONG's
    on 128 and 256."""
    import fp8_probe

    d, n = 128, 8192
    b, h = 16384 // n, 2048 // d
    long, wide = heuristics.FA3_FP8_TILES_LONG[d], heuristics.FA3_FP8_TILES_WIDE[d]
    calls = {}

    @contextmanager
    def use(tiles, kvblock):
        with fp8_tiles(d, tiles):
            calls["call"] = fp8_probe.run(b, n, n, h, h, d, False, kvblock=kvblock)[0]
            yield

    configs = {"256 keys, kv 256": lambda: use(wide, 256), "256 keys, per tensor": lambda: use(wide, None),
               "128 keys, kv 128": lambda: use(long, 128), "128 keys, kv 256": lambda: use(long, 256)}
    interleaved(f"fp8 d={d} N={n} descale blocks", configs, lambda: calls["call"], 4 * b * h * n * n * d, rounds, reps)


def fp8_scaling(rounds, reps):
    """The same FP8 d = 128 kernel on descales per 128-row block (the fp8 suite's) and per tensor: with
    per-block V descales O is rescaled at every tile (its units move from V_{n-1}'s descale to V_n's), with
    one V descale only where a row max moved."""
    import fp8_probe

    n, d = 8192, 128
    b, h = 16384 // n, 2048 // d
    calls = {"blocks of 128": fp8_probe.run(b, n, n, h, h, d, False)[0],
             "K, V per tensor": fp8_probe.run(b, n, n, h, h, d, False, kvblock=None)[0],
             "Q, K, V per tensor": fp8_probe.run(b, n, n, h, h, d, False, qblock=None, kvblock=None)[0]}
    chosen = {}

    @contextmanager
    def choose(name):
        chosen["call"] = calls[name]
        yield

    configs = {name: (lambda name=name: choose(name)) for name in calls}
    interleaved("fp8 d=128 N=8k descales", configs, lambda: chosen["call"], 4 * b * h * n * n * d, rounds, reps)


def bf16_pingpong(rounds, reps):
    import cuflash

    for d in BF16_HEADDIMS:
        for n in (2048, 8192):
            b, h, (q, k, v) = bench_shape(d, n, 3)
            for causal in (False, True):
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                configs = {"tables": as_is, "pingpong switched": lambda: pingpong_switched(d)}
                interleaved(f"fa3 bf16 d={d} N={n} causal={causal}", configs,
                            lambda: lambda: cuflash.flash_attn_func(q, k, v, causal=causal, impl="fa3"), flops,
                            rounds, reps)


def speculative_max_set(d, on):
    """bf16 FA3 forward calls at head dim d take their tiles with the speculative max (fwd.cu SPECULATIVE_MAX)
    on or off."""
    def switch(table):
        if d in table:
            table[d] = dataclasses.replace(table[d], speculative_max=on)

    return tables_edited((heuristics.FA3_TILES, heuristics.FA3_TILES_UNMASKED, heuristics.FA3_TILES_3WG), switch)


SPEC_CASES = [(n, causal) for n in (2048, 8192) for causal in (False, True)]


def fwd_spec(rounds, reps, headdims=BF16_HEADDIMS, cases=SPEC_CASES):
    import cuflash

    for d in headdims:
        for n, causal in cases:
            b, h, (q, k, v) = bench_shape(d, n, 3)
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            configs = {"after the max": lambda: speculative_max_set(d, False),
                       "speculative max": lambda: speculative_max_set(d, True)}
            interleaved(f"fa3 bf16 d={d} N={n} causal={causal}", configs,
                        lambda: lambda: cuflash.flash_attn_func(q, k, v, causal=causal, impl="fa3"), flops,
                        rounds, reps)


def bwd_dq(rounds, reps):
    import cuflash

    for d in (64, 128):
        n = 8192
        b, h, (q, k, v, do) = bench_shape(d, n, 4)
        out, lse = cuflash.flash_attn_func(q, k, v, impl="fa3", return_lse=True)
        flops = 2.5 * 4 * b * h * n * n * d

        def call():
            return lambda: cuflash.flash_attn_backward(do, q, k, v, out, lse, impl="fa3")

        configs = {"as built": lambda: bwd_defines(), "no dQ adds": lambda: bwd_defines(*NO_DQ_ADD)}
        interleaved(f"fa3 backward d={d} N=8k", configs, call, flops, rounds, reps)


def bwd_interleaved(configs, headdims, seqlens, rounds, reps, extra_kwargs=dict):
    """FA3 backward on the benchmark shapes at each head dim, length and mask (causal and not), ``configs``
    interleaved; ``extra_kwargs()``, read as each config's call is built, adds flash_attn_backward
    arguments."""
    import cuflash

    for d in headdims:
        for n in seqlens:
            b, h, (q, k, v, do) = bench_shape(d, n, 4)
            for causal in (False, True):
                out, lse = cuflash.flash_attn_func(q, k, v, causal=causal, impl="fa3", return_lse=True)
                flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)

                def call():
                    kw = dict(causal=causal, impl="fa3", **extra_kwargs())
                    return lambda: cuflash.flash_attn_backward(do, q, k, v, out, lse, **kw)

                interleaved(f"fa3 backward d={d} N={n} causal={causal}", configs, call, flops, rounds, reps)


class DetMode:
    """Configurations that call the backward in deterministic mode or not: ``config(deterministic, *ctx)``
    makes one (each use a fresh context manager, entering the context managers ``ctx`` too); ``kwargs()`` is
    the flash_attn_backward argument of the configuration being timed."""

    def __init__(self):
        self.deterministic = False

    def config(self, deterministic, *contexts):
        @contextmanager
        def run():
            self.deterministic = deterministic
            try:
                with ExitStack() as stack:
                    for ctx in contexts:
                        stack.enter_context(ctx)
                    yield
            finally:
                self.deterministic = False
        return run

    def kwargs(self):
        return {"deterministic": self.deterministic}


def bwd_det(rounds, reps):
    """FA3 backward, the default against the deterministic mode (issue 5: within 15 %)."""
    mode = DetMode()
    bwd_interleaved({"default": as_is, "deterministic": mode.config(True)}, (64, 128, 256), (2048, 8192), rounds,
                    reps, extra_kwargs=mode.kwargs)


HIGHEST_FIRST, LOWEST_FIRST = (("CUFLASH_PROBE_LAUNCH_ORDER", 1),), (("CUFLASH_PROBE_LAUNCH_ORDER", 0),)
NO_TURN, NO_WAIT_ALL = (("CUFLASH_PROBE_DET_NO_TURN", 1),), (("CUFLASH_PROBE_DET_NO_WAIT_ALL", 1),)
DET_COST_DEFINES = {"default, highest first": HIGHEST_FIRST, "det, no turn": NO_TURN,
                    "det, no turn, lowest first": NO_TURN + LOWEST_FIRST, "det, no wait-all": NO_WAIT_ALL,
                    "det, no turn, no wait-all": NO_TURN + NO_WAIT_ALL}


def bwd_det_cost(rounds, reps):
    """FA3 backward d = 128 and 256: where the deterministic mode's time goes. The default; the default launched
    highest K block first (deterministic mode's order: what the causal tail costs); deterministic; and
    deterministic without waiting for turns (dQ unordered: what the chain of turns costs), launched highest
    or lowest first, not rotated, and without (or only without) waiting for each add to land."""
    mode = DetMode()
    # (each entry a function: the context managers are made afresh at each use)
    configs = {"default": mode.config(False), "deterministic": mode.config(True)}
    for name, defines in DET_COST_DEFINES.items():
        configs[name] = lambda det=name.startswith("det"), defines=defines: mode.config(det, bwd_defines(*defines))()
    # (the rotated order's walk reads other Q blocks than its neighbours at each step)
    configs["det, no turn, not rotated"] = lambda: mode.config(
        True, bwd_defines(*NO_TURN), replaced(heuristics, "FA3_BWD_ROTATE_SM_FRACTION", 0.0))()
    bwd_interleaved(configs, (128, 256), (2048, 8192), rounds, reps, extra_kwargs=mode.kwargs)


def bwd_by_heads(label, configs, mode, heads, rounds, reps):
    """FA3 backward d = 256, N = 8k, causal and not, with (batch, heads) from ``heads`` in the grid:
    ``configs`` interleaved, ``mode`` (DetMode) saying whether each is deterministic."""
    import cuflash

    n, d = 8192, 256
    for causal in (False, True):
        for b, h in heads:
            q, k, v, do = (cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32).astype("bfloat16")
                           for _ in range(4))
            out, lse = cuflash.flash_attn_func(q, k, v, causal=causal, impl="fa3", return_lse=True)
            flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)

            def call():
                kw = dict(causal=causal, impl="fa3", **mode.kwargs())
                return lambda: cuflash.flash_attn_backward(do, q, k, v, out, lse, **kw)

            interleaved(f"{label} d={d} N=8k {b}x{h} heads causal={causal}", configs, call, flops, rounds, reps)


def bwd_det_heads(rounds, reps):
    """FA3 backward d = 256, N = 8k, causal and not: deterministic against the default by the (batch x heads)
    of the grid, 1 to 16. One head puts all 128 K blocks in one wave: each Q block's 128 adds are a chain of
    hand-offs (an add landing, its turn passed on, the next block seeing it), and the more heads share the
    GPU the more of that chain hides behind other heads' work (session 21: 0.51 / 0.62 / 0.72 / 0.875 at 1 /
    2 / 4 / 16 heads, non-causal)."""
    mode = DetMode()
    one_plane = lambda: replaced(heuristics, "FA3_DET_DQ_GRID_HEADS", 1)  # noqa: E731
    bwd_by_heads("fa3 backward", {"default": as_is, "deterministic": mode.config(True),
                                  "det, one dQ plane": lambda: mode.config(True, one_plane())()}, mode,
                 ((1, 1), (1, 2), (1, 4), (2, 8)), rounds, reps)


def bwd_rows(rounds, reps):
    """FA3 backward at d = 64, causal and not: the table's rows per step (FA3_BWD_BLOCK_M) against 80 and 64."""
    rows = lambda bm: tables_edited((heuristics.FA3_BWD_BLOCK_M,), lambda table: table.update({64: bm}))  # noqa: E731
    configs = {"table": as_is, "80 rows": lambda: rows(80), "64 rows": lambda: rows(64)}
    bwd_interleaved(configs, (64,), (2048, 4096, 8192, 16384), rounds, reps)


def bwd_dkv(rounds, reps):
    """FA3 backward: dK / dV stored by TMA through shared memory against from registers."""
    configs = {"TMA": lambda: bwd_defines(), "registers": lambda: bwd_defines(*DKV_FROM_REGISTERS)}
    bwd_interleaved(configs, (64, 128, 256), (2048, 8192), rounds, reps)


def bwd_split_sdp(rounds, reps):
    """FA3 backward at d = 256 (bwd_wide.cu): consumer 0 forms P^T and consumer 1 dS^T over the whole block
    (as built) against each consumer both for half the queries (CUFLASH_SPLIT_SDP=0)."""
    configs = {"split": lambda: bwd_defines(), "per consumer": lambda: bwd_defines(*SDP_PER_CONSUMER)}
    bwd_interleaved(configs, (256,), (2048, 8192), rounds, reps)


@contextmanager
def replaced(owner, name, value):
    """``owner.name`` is ``value`` inside the block (the plans made under either are forgotten)."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    cuflash.clear_plans()
    try:
        yield
    finally:
        setattr(owner, name, saved)
        cuflash.clear_plans()


def short_masked_rows_at(seqlen):
    """Masked rows shorter than ``seqlen`` take two warpgroups (FA3_TILES_SHORT_MASKED, FA3_TILES), longer
    FA3_TILES_3WG."""
    return replaced(heuristics, "FA3_3WG_MIN_MASKED_SEQLEN", seqlen)


def bwd_rows_from_zero():
    """fa3's backward launches take no row shift (the last Q block's spare rows after the end)."""
    return replaced(tile_order, "bwd_row_shift", lambda *args: 0)


def bwd_row_shift(rounds, reps):
    """FA3 backward: the spare rows before row 0 (as built) against none. Model (tile_order.bwd_steps):
    causal d = 128 2k / 4k -2.6 / -2.8 % of the steps, d = 64 2k -5.1 %, 4k -1.4 %."""
    bwd_interleaved({"shifted": as_is, "from row 0": bwd_rows_from_zero}, (64, 128), (2048, 4096), rounds, reps)


def fwd_interleaved(d, n, causal, configs, rounds, reps):
    """FA3 forward bf16 on the benchmark shape of head dim d and length n, ``configs`` interleaved."""
    import cuflash

    b, h, (q, k, v) = bench_shape(d, n, 3)
    interleaved(f"fa3 bf16 d={d} N={n} causal={causal}", configs,
                lambda: lambda: cuflash.flash_attn_func(q, k, v, causal=causal, impl="fa3"),
                4 * b * h * n * n * d / (2 if causal else 1), rounds, reps)


def table_row_at(table, d, **changes):
    """Calls that take ``table``'s row at head dim d take it with ``changes``."""
    return tables_edited((table,), lambda t: t.update({d: dataclasses.replace(t[d], **changes)}))


def fa3_tiles_at(d, **changes):
    """bf16 forward calls at head dim d that take FA3_TILES take its row with ``changes``."""
    return table_row_at(heuristics.FA3_TILES, d, **changes)


def d64_tiles(**changes):
    """d = 64 calls of two consumer warpgroups take FA3_TILES[64] with ``changes``."""
    return fa3_tiles_at(64, **changes)


def d64_3wg(**changes):
    """d = 64 calls of three consumer warpgroups take FA3_TILES_3WG[64] with ``changes``."""
    return table_row_at(heuristics.FA3_TILES_3WG, 64, **changes)


D64 = {  # name -> a new context manager per use. Session 17: three warpgroups took causal rows from 2k
    # (fwd-d64-causal then, TF/s, two -> three: 1k 268 -> 232, 2k 345 -> 371, 4k 391 -> 438); two warpgroups
    # with 192 keys, 64 keys, no pingpong or 4 FMNMX chains did not beat two as tabled.
    "table": as_is,
    "2 warpgroups": lambda: short_masked_rows_at(1 << 30),
    "3wg no pingpong": lambda: d64_3wg(pingpong=False),
    "3wg 3 stages": lambda: d64_3wg(stages=3),
    "3wg no overlap": lambda: d64_3wg(intra_wg_overlap=False),
    "3wg exp2 emu 4": lambda: d64_3wg(exp2_emu=4),
    # (the softmax outlasts the GEMMs at d = 64: each row's maximum is a chain of 32 dependent FMNMX)
    "4 max chains": lambda: defines_added("fwd_variant", *MAX_CHAINS_4),
}
D64_CASES = ((1024, True), (2048, True), (4096, True), (2048, False), (8192, False))  # (N, causal)


def fwd_d64(rounds, reps):
    """FA3 forward d = 64: the table's tiles against the alternatives of D64, at D64_CASES."""
    for n, causal in D64_CASES:
        fwd_interleaved(64, n, causal, D64, rounds, reps)


def fwd_tail(rounds, reps):
    """FA3 forward bf16 without a mask, d = 64 / 128 / 256, N = 2k / 4k / 8k: the stream-K tail (the last,
    part-empty round's tiles split over the keys: tile_order.tail_split) against none."""
    import time

    import cuflash

    configs = {"tail": as_is, "no tail": lambda: replaced(heuristics, "FA3_TAIL_SPLIT", False)}
    for d in BF16_HEADDIMS:
        for n in (2048, 4096, 8192):
            fwd_interleaved(d, n, False, configs, rounds, reps)
    # the host path per call (the loop does not wait for the GPU): above the kernel's time it would starve it
    b, h, (q, k, v) = bench_shape(128, 2048, 3)
    for name, config in configs.items():
        with config():
            cuflash.flash_attn_func(q, k, v, impl="fa3")
            cupy.cuda.Device().synchronize()
            start = time.perf_counter()
            for _ in range(100):
                cuflash.flash_attn_func(q, k, v, impl="fa3")
            host_us = (time.perf_counter() - start) / 100 * 1e6
            cupy.cuda.Device().synchronize()
        print(f"fa3 bf16 d=128 N=2048 host per call, {name}: {host_us:.1f} us", flush=True)


D128_CASES = [(n, causal) for n in (2048, 4096, 8192) for causal in (False, True)]


def fwd_d128_stages(rounds, reps):
    """FA3 forward bf16 d = 128, N = 2k, 4k, 8k, causal and not: two K / V stages and O stored through shared
    memory by TMA (the table) against three stages, which leave no room for the O staging (O stored from
    registers): cuDNN's kernel there asks for all 232 448 bytes of shared memory, ours 198 736."""
    configs = {"table": as_is, "3 stages": lambda: fa3_tiles_at(128, stages=3)}
    for n, causal in D128_CASES:
        fwd_interleaved(128, n, causal, configs, rounds, reps)


def fwd_d128_overlap(rounds, reps):
    """FA3 forward bf16 d = 128, N = 2k, 4k, 8k, causal and not: the table (S_{n+1} issued with P_n V_n within
    a warpgroup, no pingpong) against cuDNN's arrangement there (its SASS under ncu, session 24: each
    consumer runs S, waits, softmax, P V, waits, the softmaxes of the two taking turns by named barriers),
    i.e. no overlap within a warpgroup with the pingpong, and without either."""
    configs = {"table": as_is,
               "pingpong, no overlap": lambda: fa3_tiles_at(128, intra_wg_overlap=False, pingpong=True),
               "neither": lambda: fa3_tiles_at(128, intra_wg_overlap=False, pingpong=False)}
    for n, causal in D128_CASES:
        fwd_interleaved(128, n, causal, configs, rounds, reps)


def rows_from_zero():
    """fa3's launches tile the query rows from row 0 (no row_shift: the spare rows after the end)."""
    def unshifted(m_blocks, block_m, block_n, seqlen_q, seqlen_k, window):
        return 0, tile_order.tile_costs(m_blocks, block_m, block_n, seqlen_q, seqlen_k, window)

    return replaced(tile_order, "row_shift", unshifted)


@contextmanager
def three_warpgroups_from_row_0():
    with short_masked_rows_at(0), rows_from_zero():
        yield


def fwd_row_shift(rounds, reps):
    """FA3 forward, causal: the spare rows before row 0 (as built) against after the end; and at d = 64 N =
    1k, where two warpgroups are tabled (three lost there with the spare rows at the end: 1024 = 5 x 192 +
    64 leaves the dearest tile two thirds empty), three with the shift (16 % fewer K tiles) against both."""
    cases = [(64, 2048, {"shifted": as_is, "from row 0": rows_from_zero}),
             (64, 4096, {"shifted": as_is, "from row 0": rows_from_zero}),
             (64, 8192, {"shifted": as_is, "from row 0": rows_from_zero}),
             (128, 2048, {"shifted": as_is, "from row 0": rows_from_zero}),
             (64, 1024, {"table (2 warpgroups)": as_is, "3 warpgroups, shifted": lambda: short_masked_rows_at(0),
                         "3 warpgroups, from row 0": three_warpgroups_from_row_0})]
    for d, n, configs in cases:
        fwd_interleaved(d, n, True, configs, rounds, reps)


SHORT_CASES = [(n, causal) for n in (512, 1024) for causal in (False, True)]


def fwd_short_configs(d):
    # (session 31 also measured the next tile's Q, and its first K / V, prefetched into L2 by the producer
    # (cp.async.bulk.prefetch.tensor): level or 1-6 % slower at every cell; removed)
    configs = {"table": as_is, "pingpong switched": lambda: pingpong_switched(d)}
    if d == 64:
        configs["2 warpgroups"] = lambda: short_masked_rows_at(1 << 30)  # (causal; unmasked rows: FA3_TILES_3WG still)
        # unmasked rows on two warpgroups (N = 512 is 2 x 192 + 128 rows on three: a tile in three a third empty)
        configs["2 wg unmasked"] = lambda: tables_edited((heuristics.FA3_TILES_3WG,), lambda table: table.pop(64))
        configs["2 wg unmasked, 128 keys"] = lambda: tables_edited(
            (heuristics.FA3_TILES_3WG, heuristics.FA3_TILES_UNMASKED), lambda table: table.pop(64))
    return configs


IDLE_WG_OFF = (("CUFLASH_IDLE_WG_SKIP", 0),)
IDLE_CASES = [(512, False), (512, True), (1024, False), (1024, True), (2048, True), (2048, False), (4096, True)]


def fwd_idle_wg(rounds, reps):
    """FA3 forward bf16 d = 64 (three consumer warpgroups): warpgroups without a row of the sequence sitting
    their tiles out (fwd.cu IDLE_WG_SKIP, as built) against computing them."""
    configs = {"idle skip": as_is, "idle computes": lambda: defines_added("fwd_variant", *IDLE_WG_OFF)}
    for n, causal in IDLE_CASES:
        fwd_interleaved(64, n, causal, configs, rounds, reps)


D128_DIV_CASES = [(n, causal) for n in (512, 2048, 4096, 8192, 16384) for causal in (False, True)]


BF16_FORWARD_TABLES = (heuristics.FA3_TILES, heuristics.FA3_TILES_UNMASKED, heuristics.FA3_TILES_3WG,
                       heuristics.FA3_TILES_SHORT_MASKED, heuristics.FA3_TILES_LONG)
Q_STAGES_CASES = {64: SHORT_CASES + [(2048, True)], 128: SHORT_CASES + [(2048, False), (2048, True)]}


def bf16_rows_at(d, **changes):
    """bf16 forward calls at head dim d take their table's row (any of them) with ``changes``."""
    def edit(table):
        if d in table:
            table[d] = dataclasses.replace(table[d], **changes)
    return tables_edited(BF16_FORWARD_TABLES, edit)


def fwd_q_stages(rounds, reps):
    """FA3 forward bf16 d = 64 / 128, N = 512, 1k (2k), causal and not: the tables (two Q buffers at d = 64 since
    session 33, one at d = 128) against one and two (Fa3Tiles.q_stages 2: the next tile's Q and first K / V
    load while this tile runs)."""
    for d, cases in Q_STAGES_CASES.items():
        configs = {"table": as_is, "one Q buffer": lambda: bf16_rows_at(d, q_stages=1),
                   "two Q buffers": lambda: bf16_rows_at(d, q_stages=2)}
        for n, causal in cases:
            fwd_interleaved(d, n, causal, configs, rounds, reps)


def fwd_tail_short(rounds, reps):
    """FA3 forward bf16 without a mask at N = 2k, d = 64 / 128 / 256: the table's rule (no stream-K tail
    there: FA3_TAIL_MIN_GAIN) against the tail wherever the model gains (session 23 measured 2k d = 128 level,
    d = 256 -3 %; the per-tile trims of session 32 made a piece's fixed costs smaller)."""
    configs = {"table": as_is, "tail at any gain": lambda: replaced(heuristics, "FA3_TAIL_MIN_GAIN", 0.0)}
    for d in BF16_HEADDIMS:
        fwd_interleaved(d, 2048, False, configs, rounds, reps)


def fwd_d128_div(rounds, reps):
    """FA3 forward bf16 d = 128: the tile order as tabled (FastDivmods below FA3_LONG_MIN_SEQLEN rows, `/`
    and `%` from there: Fa3Tiles.fast_tile_div) against FastDivmods and plain division at every length."""
    configs = {"table": as_is, "FastDivmods": lambda: table_row_at(heuristics.FA3_TILES_LONG, 128, fast_tile_div=True),
               "plain division": lambda: fa3_tiles_at(128, fast_tile_div=False)}
    for n, causal in D128_DIV_CASES:
        fwd_interleaved(128, n, causal, configs, rounds, reps)


def fwd_short(rounds, reps):
    for d in (64, 128):
        for n, causal in SHORT_CASES:
            fwd_interleaved(d, n, causal, fwd_short_configs(d), rounds, reps)


def old_tile_order():
    """fa3's launches take the scheduler's order by the kernel's rule before session 16: with a mask and
    fewer pairs than half the grid one section of every pair with the serpentine, else the budget's
    sections, the serpentine only when one holds every pair."""
    def old(m_blocks, pairs, grid, fit, m_costs, all_pairs_ok=True):
        return (pairs, True) if m_costs is not None and 2 * pairs < grid else (fit, fit >= pairs)

    return replaced(tile_order, "choose", old)


def fwd_order(rounds, reps):
    """FA3 forward, causal: the model's tile order against the old rule."""
    for d in BF16_HEADDIMS:
        for n in (512, 1024, 2048, 4096, 8192):
            fwd_interleaved(d, n, True, {"model": as_is, "old rule": old_tile_order}, rounds, reps)


def fixed_sections(section, serpentine):
    """fa3's launches take sections of ``section`` pairs (at most all of them) and the given deal, whatever
    the model and the budget say."""
    return replaced(tile_order, "choose", lambda m_blocks, pairs, grid, fit, m_costs, all_pairs_ok=True: (min(section, pairs), serpentine))


def fwd_wide_sections(rounds, reps):
    """FA3 forward, causal: heuristics.FA3_WIDE_SECTION_MAX_STREAM_BYTES as built against no limit (session 16's
    rule: one section of every pair wherever the balance model rates it 2 % better), at the shapes where the
    limit or a lower one would change the order (d = 128 4k / 8k, d = 256 4k, d = 64 8k / 16k)."""
    configs = {"as built": as_is, "no limit": lambda: replaced(heuristics, "FA3_WIDE_SECTION_MAX_STREAM_BYTES", 1 << 40)}
    for d, n in ((128, 4096), (128, 8192), (256, 4096), (64, 8192), (64, 16384)):
        fwd_interleaved(d, n, True, configs, rounds, reps)


def fwd_sections(rounds, reps):
    """FA3 forward: the model's tile order (tile_order.choose) against fixed L2 sections. With fewer pairs than
    half the grid and a mask the model takes one section of every pair where its balance model says 2 %
    better (causal d = 128 4k: 64 pairs, 2 MiB of K/V each), which leaves L2 nothing to share: the prefill
    suite (3 rounds) read causal 4k at 0.93 of cuDNN against 1.04 at 2k (sections of 2)."""
    configs = {"model": as_is, "1 serp": lambda: fixed_sections(1, True), "2 serp": lambda: fixed_sections(2, True),
               "4 serp": lambda: fixed_sections(4, True), "2 plain": lambda: fixed_sections(2, False)}
    for d, n, causal in ((128, 4096, True), (128, 8192, True), (256, 4096, True), (256, 8192, True),
                         (128, 2048, False), (128, 2048, True)):
        fwd_interleaved(d, n, causal, configs, rounds, reps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiments", nargs="*", default=["fp8-d128", "bwd-dq"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--list-variants", action="store_true")
    args = parser.parse_args()
    if args.list_variants:
        for v in list_variants():
            print(v.name)
        return
    runs = {"fp8-d128": lambda *a: fp8_forward(128, *a), "fp8-d64": lambda *a: fp8_forward(64, *a),
            "fp8-scaling": fp8_scaling, "fp8-d128-keys": fp8_keys, "fp8-d128-blocks": fp8_keys_blocks, "fp8-d128-spec": lambda *a: fp8_spec((128,), (2048, 8192, 16384), 256, heuristics.FA3_FP8_TILES_WIDE.get, *a),
            "fp8-d64-wide": fp8_d64_wide, "fp8-wide-pingpong": fp8_wide_pingpong, "fp8-p-smem": fp8_p_smem, "fp8-3wg": fp8_3wg, "fp8-d128-p-smem": fp8_d128_p_smem, "fp8-p-smem-decay": fp8_p_smem_decay, "fp8-spec-long": lambda *a: fp8_spec((64, 128), (2048, 8192), 128, fp8_long_tiles, *a), "bf16-pingpong": bf16_pingpong, "bwd-dq": bwd_dq,
            "bwd-det": bwd_det, "bwd-det-cost": bwd_det_cost, "bwd-det-heads": bwd_det_heads, "bwd-rows": bwd_rows, "bwd-dkv": bwd_dkv, "bwd-split-sdp": bwd_split_sdp,
            "fwd-spec": fwd_spec,
            "fwd-spec-d128": lambda *a: fwd_spec(*a, headdims=(128,), cases=[(n, c) for n in (2048, 4096) for c in (False, True)]), "fwd-order": fwd_order, "fwd-sections": fwd_sections, "fwd-wide-sections": fwd_wide_sections, "fwd-d64": fwd_d64, "fwd-tail": fwd_tail, "fwd-d128-stages": fwd_d128_stages, "fwd-d128-overlap": fwd_d128_overlap, "fwd-row-shift": fwd_row_shift, "fwd-short": fwd_short, "fwd-idle-wg": fwd_idle_wg, "fwd-d128-div": fwd_d128_div, "fwd-tail-short": fwd_tail_short, "fwd-q-stages": fwd_q_stages, "bwd-row-shift": bwd_row_shift}
    for name in args.experiments:
        runs[name](args.rounds, args.reps)


if __name__ == "__main__":
    main()
