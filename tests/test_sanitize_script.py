"""scripts/sanitize.sh reads compute-sanitizer's summaries right (CPU tier: a stand-in sanitizer prints
canned logs, so the classification is tested without a GPU)."""
import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What the stand-in prints for each (tool, family): real summary lines of compute-sanitizer 2025.3.
CANNED = {
    ("memcheck", "clean"): "========= ERROR SUMMARY: 0 errors",
    ("memcheck", "oob"): "========= Invalid __global__ read of size 4 bytes\n========= ERROR SUMMARY: 1 error",
    ("memcheck", "probes"): "\n".join(
        ['========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call '
         'to cuGetProcAddress_v2.'] * 3 + ["========= ERROR SUMMARY: 3 errors"]),
    ("memcheck", "probes+api"): "\n".join(
        ['========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call '
         'to cuGetProcAddress_v2.',
         '========= Program hit CUDA_ERROR_ILLEGAL_ADDRESS (error 700) on CUDA API call to cuMemcpyDtoH.',
         "========= ERROR SUMMARY: 2 errors"]),
    ("racecheck", "clean"): "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)",
    ("racecheck", "race"): "========= Error: Race reported between Write access at f+0x10\n"
                           "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)",
    ("racecheck", "silent"): "nothing",
}


@pytest.fixture
def fake_sanitizer(tmp_path):
    script = tmp_path / "compute-sanitizer"
    lines = ["#!/usr/bin/env bash", 'if [ "$1" = --version ]; then echo "Version 2025.3.1.0"; exit 0; fi',
             'tool=$2; fam=${@: -1}', 'case "$tool $fam" in']
    for (tool, fam), text in CANNED.items():
        quoted = text.replace("'", "'\\''")
        lines.append(f"  '{tool} {fam}') printf '%s\\n' '{quoted}' ;;")
    lines += ["esac", "exit 0"]
    script.write_text("\n".join(lines) + "\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def _run(fake_sanitizer, tmp_path, tool, family):
    env = dict(os.environ, COMPUTE_SANITIZER=str(fake_sanitizer), PYTHON="true", OUT=str(tmp_path / "out"),
               SANITIZE_TOOLS=tool, SANITIZE_FAMILIES=family)
    res = subprocess.run(["bash", str(ROOT / "scripts" / "sanitize.sh")], capture_output=True, text=True, env=env)
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith(tool))
    return res.returncode, line


@pytest.mark.parametrize("tool, family, expect, ok", [
    ("memcheck", "clean", "clean", True),
    ("memcheck", "oob", "1 ERROR(S)", False),
    ("memcheck", "probes", "clean", True),  # cuda.bindings' cuGetProcAddress probes are not errors
    ("memcheck", "probes+api", "1 ERROR(S) (1 CUDA API)", False),
    ("racecheck", "clean", "clean", True),
    ("racecheck", "race", "1 ERROR(S)", False),
    ("racecheck", "silent", "NO SUMMARY", False),
])
def test_sanitize_summary_parsing(fake_sanitizer, tmp_path, tool, family, expect, ok):
    rc, line = _run(fake_sanitizer, tmp_path, tool, family)
    assert expect in line, line
    assert (rc == 0) == ok, line
