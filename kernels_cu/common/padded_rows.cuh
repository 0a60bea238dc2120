// Where a packed sequence's rows go in the FA3 backward's padded LSE / D rows (one padded row per head):
// sequence b, whose packed rows start at cu_start = cu_seqlens_q[b], starts at row
// round_up(cu_start, 64) + 64 b, so every 64-row block TMA loads from it starts 16-byte aligned and no two
// sequences' blocks overlap (cuflash/fa3.py sizes the row: fa3.varlen_row_pitch). Used by bwd_aux.cu (which
// writes the rows) and fa3/bwd.cu (which loads them); tests/test_padded_rows.py builds it on the host.
#pragma once

__host__ __device__ constexpr int padded_seq_start(int cu_start, int b) { return (cu_start + 63) / 64 * 64 + 64 * b; }
