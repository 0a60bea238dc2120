"""CPU tier: the programmatic dependent launch of decode's combine (cuflash._jit.launch_dependent).

The ctypes mirrors of cuda.h's launch structs (a wrong offset would hand the driver garbage), the packing
of one launch through a fake driver, the fallback below sm_90, and the machine code: decode_fwd triggers
its dependents (griddepcontrol.launch_dependents -> PREEXIT) and attn_combine waits for its prerequisite
(griddepcontrol.wait -> ACQBULK) before its first global load, on sm_90a; neither on sm_80."""
import ctypes
import re
import subprocess
import tempfile
import types

import numpy as np
import pytest

from cuflash import _device, _jit, compile_report, decode
from cuflash._jit import CUlaunchAttribute, CUlaunchAttributeValue, CUlaunchConfig


def test_launch_structs_match_cuda_h():
    """Sizes and offsets of CUlaunchAttribute / CUlaunchConfig in cuda.h (CUDA 12 and 13) on 64-bit."""
    assert ctypes.sizeof(CUlaunchAttributeValue) == 64
    assert ctypes.sizeof(CUlaunchAttribute) == 72
    assert (CUlaunchAttribute.id.offset, CUlaunchAttribute.value.offset) == (0, 8)
    assert ctypes.sizeof(CUlaunchConfig) == 56
    offsets = {name: getattr(CUlaunchConfig, name).offset for name, _ in CUlaunchConfig._fields_}
    assert offsets == {"gridDimX": 0, "gridDimY": 4, "gridDimZ": 8, "blockDimX": 12, "blockDimY": 16,
                       "blockDimZ": 20, "sharedMemBytes": 24, "hStream": 32, "attrs": 40, "numAttrs": 48}
    assert _jit.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6


class FakeDriver:
    """Stands in for libcuda: records what cuLaunchKernelEx was handed, read while the call lasts."""

    def __init__(self, result=0):
        self.result, self.calls = result, []

    def cuLaunchKernelEx(self, config_ref, fn, params, extra):
        cfg = config_ref._obj
        attrs = [(cfg.attrs[i].id, cfg.attrs[i].value.programmaticStreamSerializationAllowed)
                 for i in range(cfg.numAttrs)]
        self.calls.append({
            "grid": (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ), "block": (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ),
            "smem": cfg.sharedMemBytes, "stream": cfg.hStream, "attrs": attrs, "fn": fn, "params": list(params),
            "extra": extra})
        return self.result

    def cuGetErrorName(self, err, name_ref):
        name_ref._obj.value = b"CUDA_ERROR_INVALID_VALUE"
        return 0


@pytest.fixture
def fake_gpu(monkeypatch):
    """A fake device of the compute capability in state["cc"]; plain launches recorded in state["launch"]."""
    state = {"cc": (9, 0), "launch": [], "driver": FakeDriver()}
    monkeypatch.setattr(_device, "device_id", lambda: 0)
    monkeypatch.setattr(_device, "compute_capability", lambda device=0: state["cc"])
    monkeypatch.setattr(_jit, "get_function", lambda variant: types.SimpleNamespace(ptr=0xF00D))
    monkeypatch.setattr(_jit, "launch", lambda *args: state["launch"].append(args))
    monkeypatch.setattr(_jit, "_libcuda", lambda: state["driver"])
    return state


STREAM = types.SimpleNamespace(ptr=0x5EA)


def test_launch_dependent_packs_one_programmatic_launch(fake_gpu):
    variant = decode.combine_variant("bfloat16")
    p = np.zeros(1, decode.COMBINE_PARAMS)
    _jit.launch_dependent(variant, (37,), (p,), STREAM)
    assert not fake_gpu["launch"]
    (call,) = fake_gpu["driver"].calls
    assert call["grid"] == (37, 1, 1) and call["block"] == (variant.threads, 1, 1)
    assert call["smem"] == variant.smem_bytes and call["stream"] == STREAM.ptr and call["fn"] == 0xF00D
    assert call["attrs"] == [(6, 1)]
    assert call["params"] == [p.ctypes.data] and call["extra"] is None


def test_launch_dependent_raises_with_the_error_name(fake_gpu):
    fake_gpu["driver"] = FakeDriver(result=1)
    with pytest.raises(RuntimeError, match=r"cuLaunchKernelEx of decode\.attn_combine.*CUDA_ERROR_INVALID_VALUE \(1\)"):
        _jit.launch_dependent(decode.combine_variant("float32"), (1,), (np.zeros(1, decode.COMBINE_PARAMS),), STREAM)


@pytest.mark.parametrize("cc", [(8, 0), (8, 9)])
def test_launch_dependent_is_a_plain_launch_below_sm90(fake_gpu, cc):
    fake_gpu["cc"] = cc
    variant, p = decode.combine_variant("float16"), np.zeros(1, decode.COMBINE_PARAMS)
    _jit.launch_dependent(variant, (5,), (p,), STREAM)
    assert fake_gpu["launch"] == [(variant, (5,), (p,), STREAM)] and not fake_gpu["driver"].calls


class Dev:
    """Enough of a CuPy array for decode.combine: shape, strides, dtype and a device pointer."""

    def __init__(self, shape, dtype, ptr):
        a = np.empty(shape, dtype)
        self.shape, self.strides, self.dtype = a.shape, a.strides, a.dtype
        self.data = types.SimpleNamespace(ptr=ptr)


@pytest.mark.parametrize("after_split", [False, True])
def test_combine_launches_as_a_dependent_only_after_the_split_kernel(monkeypatch, after_split):
    launched = []
    monkeypatch.setattr(decode, "launch", lambda *a: launched.append("launch"))
    monkeypatch.setattr(decode, "launch_dependent", lambda *a: launched.append("launch_dependent"))
    ns, b, s, h, d = 3, 2, 1, 8, 128
    decode.combine(Dev((ns, b, s, h, d), np.float32, 0x1000), Dev((ns, b, h, s), np.float32, 0x2000),
                   Dev((b, s, h, d), np.float16, 0x3000), Dev((b, h, s), np.float32, 0x4000), STREAM,
                   after_split=after_split)
    assert launched == ["launch_dependent" if after_split else "launch"]


def _sass(variant, arch):
    tool = compile_report.find_tool("nvdisasm")
    if tool is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(_jit.compile_variant(variant, arch).cubin)
        fh.flush()
        return subprocess.run([tool, "-c", fh.name], capture_output=True, text=True, check=True).stdout


FWD = [decode.fwd_variant(d, dtype, paged) for dtype in ("bfloat16", "float16") for d in decode.HEADDIMS
       for paged in (False, True)]
COMBINE = [decode.combine_variant(t) for t in decode.COMBINE_DTYPE_CODES]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("variant", FWD + COMBINE, ids=lambda v: v.name)
def test_dependent_launch_machine_code(variant, arch):
    """sm_90a: decode_fwd has one PREEXIT (launch_dependents) and no ACQBULK; attn_combine has its
    ACQBULK (wait) ahead of its first global load, and no PREEXIT. sm_80: neither (the wrappers compile
    to nothing there)."""
    ops = re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", _sass(variant, arch), re.MULTILINE)
    names = [op.split(".")[0] for op in ops]  # in address order
    if arch == "sm_80":
        assert "PREEXIT" not in names and "ACQBULK" not in names
        return
    if variant.kernel == "decode_fwd":
        assert names.count("PREEXIT") == 1 and "ACQBULK" not in names
    else:
        assert names.count("ACQBULK") == 1 and "PREEXIT" not in names
        assert names.index("ACQBULK") < names.index("LDG"), "the combine reads global memory before its wait"
