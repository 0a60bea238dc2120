"""CPU tier: scripts/ncu_sass_stalls.py reads the per-instruction CSV of `NCU_SASS=... ncu_profile.sh` (one
table per kernel after a "Kernel Name" line, ncu's messages around them) and sums the stall samples."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "ncu_sass_stalls.py"

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"L2 Theoretical Sectors Global Excessive","L2 Theoretical Sectors Global","stall_barrier","stall_long_sb",'
          '"stall_wait","stall_barrier (Not Issued)"\n')
CSV = ('==PROF== Connected to process 1 (/usr/bin/python3)\n'
       '"Kernel Name","fa3_bwd",\n' + HEADER
       + '"0x7f00000b6d50","      BAR.SYNC.DEFER_BLOCKING 0x1, 0x100","10","9","0","0","0","0","10","9"\n'
       + '"0x7f00000b6d60","      STS [R179+0x20000], R152","1,200","1,100","0","0","1,150","0","50","1,100"\n'
       + '"0x7f00000b7ed0","      STG.E desc[UR56][R12.64], R89","40","30","65,536","131,072","0","40","0","0"\n'
       + '==PROF== Disconnected from process 1\n'
       + '"Kernel Name","bwd_convert_dq",\n' + HEADER
       + '"0x7f00000c0000","      LDG.E R0, desc[UR4][R2.64]","5","5","0","0","0","5","0","0"\n')


def _script():
    spec = importlib.util.spec_from_file_location("ncu_sass_stalls", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tables_per_kernel_and_the_summary(tmp_path, capsys):
    mod = _script()
    path = tmp_path / "sass.csv"
    path.write_text(CSV)
    tables = mod.kernels(path)
    assert list(tables) == ["fa3_bwd", "bwd_convert_dq"]
    assert [r["Address"][-5:] for r in tables["fa3_bwd"]] == ["b6d50", "b6d60", "b7ed0"]
    assert mod.number("1,200") == 1200.0 and mod.number("-") == 0.0
    mod.report("fa3_bwd", tables["fa3_bwd"], top=2)
    out = capsys.readouterr().out
    # samples by reason (the "Not Issued" columns are a subset, not added): barrier 1150, wait 60, long_sb 40
    assert "1250 stall samples" in out and "barrier 92%" in out and "wait 5%" in out and "long_sb 3%" in out
    lines = out.splitlines()
    top = lines[lines.index("  top 2 instructions by samples:") + 1]
    assert "b6d60" in top and "STS" in top and "barrier 1150" in top
    assert "65,536 of      131,072  STG.E" in out  # the uncoalesced store
