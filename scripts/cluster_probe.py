"""How many thread-block clusters of the decode kernel (d = 128) can be resident at once on this GPU
(cuOccupancyMaxActiveClusters), for cluster sizes 8 and 16 (16 is non-portable) at the kernel's own dynamic
shared memory (two blocks fit per SM) and at 120 KB (one block per SM): whether 8 KV heads x 16 splits can
run as 8 clusters of 16 at one block per SM, the precondition of a split merge through distributed shared
memory."""
import ctypes
import struct

from cuflash import _jit, decode
from cuflash._jit import CUlaunchAttribute, CUlaunchConfig

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


def cluster_attribute(size: int) -> CUlaunchAttribute:
    """_jit's launch attribute (its union names only the PDL value) holding a cluster of ``size`` x 1 x 1."""
    attr = CUlaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
    dims = struct.pack("3I", size, 1, 1)
    ctypes.memmove(ctypes.addressof(attr.value), dims, len(dims))
    return attr


def main():
    lib = ctypes.CDLL("libcuda.so.1")
    variant = decode.fwd_variant(128, "bfloat16", False)
    fn = ctypes.c_void_p(_jit.get_function(variant).ptr)
    print(lib.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
          lib.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 200 * 1024), "(set attributes)")
    for size in (8, 16):
        for smem in (variant.smem_bytes, 120 * 1024):
            attr = cluster_attribute(size)
            config = CUlaunchConfig(16 * size, 8, 1, variant.threads, 1, 1, smem, None, ctypes.pointer(attr), 1)
            n = ctypes.c_int(-1)
            err = lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), fn, ctypes.byref(config))
            print(f"cluster {size:2d}, {smem // 1024} KB smem per block: max active clusters {n.value} (err {err})")


if __name__ == "__main__":
    main()
