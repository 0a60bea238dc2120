"""Build a tests/cpp/*.cpp host harness of a kernel header with g++ into a shared library (ctypes), so the
CPU tier checks the very arithmetic the kernels run (index maps, schedulers, fast division, hashes)."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(harness: str, include_dir: str, out_dir) -> ctypes.CDLL:
    """tests/cpp/<harness> built against kernels_cu/<include_dir> into out_dir; skips without g++, fails
    with the compiler's output when the build fails. -fwrapv: a 32-bit overflow shows up as a wrong answer
    the tests catch (GPU integers wrap too) instead of undefined behaviour the optimiser may exploit."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed: cannot build the host harness")
    src = os.path.join(REPO, "tests", "cpp", harness)
    out = os.path.join(str(out_dir), os.path.splitext(harness)[0] + ".so")
    cmd = ["g++", "-std=c++17", "-O1", "-fwrapv", "-Wall", "-Wextra", "-shared", "-fPIC", "-I",
           os.path.join(REPO, "kernels_cu", include_dir), src, "-o", out]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        pytest.fail(f"building {harness} failed:\n{' '.join(cmd)}\n{res.stderr}")
    return ctypes.CDLL(out)
