"""bench/e2e_gpt.py on the CPU (``--cpu-smoke``): the GPT model, the data, the training loop, the report
and the loss check run end to end with torch's sdpa and the naive attention, and their loss curves
agree. Skipped where torch is not installed; the GPU run (with cuflash) is the lead's H200 job."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "e2e_gpt.py"


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def test_cpu_smoke_runs_and_sdpa_matches_naive(tmp_path):
    out = tmp_path / "e2e.json"
    proc = _run("--cpu-smoke", "--json", str(out))
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    data = json.loads(out.read_text())

    results = {r["attn"]: r for r in data["results"]}
    assert set(results) == {"sdpa", "naive"}
    steps = data["config"]["warmup"] + data["config"]["steps"]
    for r in results.values():
        assert r["status"] == "ok" and r["finite"]
        assert len(r["losses"]) == steps
        assert r["tokens_per_s"] > 0
        # random tokens over a 512-word vocabulary: the loss starts near ln(512)
        assert abs(r["losses"][0] - math.log(data["config"]["vocab"])) < 0.5

    sdpa, naive = results["sdpa"]["losses"], results["naive"]["losses"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(naive, sdpa))
    assert rel <= 2e-2, f"naive vs sdpa per-step losses differ by {rel:.2e} (relative): {naive} vs {sdpa}"
    check = data["loss_check"]
    assert check["passed"] and check["compared"] == 1
    assert check["rows"][0]["attn"] == "naive" and check["rows"][0]["reference"] == "sdpa"
    assert "loss curves against sdpa" in proc.stdout


def test_loss_check_failure_exits_nonzero():
    """An impossible tolerance fails the check (exit 1) unless --no-check."""
    assert _run("--cpu-smoke", "--rtol", "-1", "--steps", "1", "--warmup", "0").returncode == 1
    assert _run("--cpu-smoke", "--rtol", "-1", "--steps", "1", "--warmup", "0", "--no-check").returncode == 0


def test_cuflash_is_refused_on_the_cpu():
    proc = _run("--cpu-smoke", "--attn", "cuflash,sdpa")
    assert proc.returncode == 2 and "cuflash needs a CUDA GPU" in proc.stderr
