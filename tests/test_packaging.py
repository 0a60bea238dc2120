"""CPU tier: a non-editable install carries the CUDA sources inside the package."""
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_contains_kernel_sources(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("cuflash-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(ROOT / "kernels_cu").as_posix() for p in (ROOT / "kernels_cu").rglob("*.cu*")}
    assert sources
    for rel in sources:
        assert f"cuflash/kernels_cu/{rel}" in names, rel
    assert "cuflash/api.py" in names
