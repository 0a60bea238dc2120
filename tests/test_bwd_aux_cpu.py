"""CPU tier: the launch rules of the backward's pre/post passes (cuflash/_bwd_aux.py, kernels_cu/common/bwd_aux.cu).
A row's lanes are its 16-byte chunks rounded up to a power of two, so a 128-thread block covers 128 / lanes
rows; the kernels index rows in 32 bits, so the launcher refuses 2^31 rows or more before launching
anything, and launches nothing for zero rows."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from cuflash import _bwd_aux


@pytest.mark.parametrize("headdim, rows", [(32, 32), (64, 16), (96, 8), (128, 8), (192, 4), (256, 4)])
def test_rows_per_block(headdim, rows):
    assert _bwd_aux.rows_per_block(headdim) == rows
    lanes = _bwd_aux.THREADS // rows
    assert lanes >= headdim // 8 and lanes & (lanes - 1) == 0 and lanes <= 32


def test_too_many_rows_is_refused_before_any_launch(monkeypatch):
    monkeypatch.setattr(_bwd_aux, "launch", lambda *a, **k: pytest.fail("launched"))
    dims = SimpleNamespace(batch=2**12, heads=2**10, seqlen_q=2**9, headdim=64, dtype="bfloat16")  # 2^31 rows
    with pytest.raises(ValueError, match="2\\^31"):
        _bwd_aux._launch("bwd_preprocess", None, dims, None)


def test_zero_rows_launch_nothing(monkeypatch):
    monkeypatch.setattr(_bwd_aux, "launch", lambda *a, **k: pytest.fail("launched"))
    dims = SimpleNamespace(batch=3, heads=4, seqlen_q=0, headdim=128, dtype="bfloat16")
    _bwd_aux._launch("bwd_convert_dq", None, dims, None)


def test_grid_covers_every_row(monkeypatch):
    calls = []
    monkeypatch.setattr(_bwd_aux, "launch", lambda v, grid, args, stream: calls.append(grid))
    dims = SimpleNamespace(batch=3, heads=5, seqlen_q=77, headdim=96, dtype="float16")
    _bwd_aux._launch("bwd_preprocess", None, dims, None)
    (blocks,), = calls
    rows = 3 * 5 * 77
    assert (blocks - 1) * _bwd_aux.rows_per_block(96) < rows <= blocks * _bwd_aux.rows_per_block(96)
