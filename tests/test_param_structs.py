"""Every kernel parameter struct in C (FA1, FA2, FA3, the backward passes, decode, fp8) and its numpy mirror in
Python agree field by field (CPU tier): NVRTC compiles a probe of static_asserts on sizeof and offsetof.
A mismatch would hand kernels garbage."""
import numpy as np
import pytest

from cuflash import _bwd_aux, _jit, decode, fa1, fa2, fa3, fp8

# (C struct, numpy mirror, file that defines the struct, defines that file needs)
STRUCTS = [
    ("Fa1FwdParams", fa1.FWD_PARAMS, "fa1/params.cuh", ()),
    ("Fa1BwdParams", fa1.BWD_PARAMS, "fa1/params.cuh", ()),
    ("Fa2FwdParams", fa2.FWD_PARAMS, "fa2/params.cuh", ()),
    ("Fa2BwdParams", fa2.BWD_PARAMS, "fa2/params.cuh", ()),
    ("Fa3FwdParams", fa3.PARAMS, "fa3/params.cuh", ()),
    ("Fa3BwdParams", fa3.BWD_PARAMS, "fa3/bwd_params.cuh", ()),
    ("BwdAuxParams", _bwd_aux.PARAMS, "common/bwd_aux.cu", (("CUFLASH_HEADDIM", 64), ("CUFLASH_DTYPE", 0))),
    ("DecodeParams", decode.FWD_PARAMS, "decode/params.cuh", ()),
    ("AppendParams", decode.APPEND_PARAMS, "decode/params.cuh", ()),
    ("CombineParams", decode.COMBINE_PARAMS, "decode/combine.cu", (("CUFLASH_OUT_DTYPE", 2),)),
    ("Fp8QuantParams", fp8.PARAMS, "fp8/params.cuh", ()),
]


def layout_probe(struct: str, dtype: np.dtype, include: str) -> str:
    """CUDA source that fails to compile unless ``struct`` has ``dtype``'s size and field offsets."""
    lines = [f'#include "{include}"',
             f'static_assert(sizeof({struct}) == {dtype.itemsize}, "sizeof {struct}");']
    for name in dtype.names:
        offset = dtype.fields[name][1]
        lines.append(f'static_assert(__builtin_offsetof({struct}, {name}) == {offset}, "{struct}.{name}");')
    return "\n".join(lines) + '\nextern "C" __global__ void probe() {}\n'


@pytest.mark.parametrize("struct,dtype,include,defines", STRUCTS, ids=[s[0] for s in STRUCTS])
def test_struct_matches_numpy_mirror(tmp_path, monkeypatch, struct, dtype, include, defines):
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / f"probe_{struct}.cu"
    src.write_text(layout_probe(struct, dtype, include))
    _jit.compile_variant(_jit.Variant("probe", str(src), "probe", tuple(defines)), "sm_80")


def test_probe_catches_a_moved_field(tmp_path, monkeypatch):
    """The probe is not vacuous: a mirror with two fields swapped does not compile."""
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "cache"))
    names = list(fa3.BWD_PARAMS.names)
    names[0], names[1] = names[1], names[0]
    swapped = np.dtype([(n, fa3.BWD_PARAMS.fields[n][0]) for n in names], align=True)
    src = tmp_path / "probe_swapped.cu"
    src.write_text(layout_probe("Fa3BwdParams", swapped, "fa3/bwd_params.cuh"))
    with pytest.raises(_jit.CompileError, match="Fa3BwdParams.cu_seqlens"):
        _jit.compile_variant(_jit.Variant("probe", str(src), "probe", ()), "sm_80")
