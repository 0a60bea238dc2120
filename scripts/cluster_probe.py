"""How many thread-block clusters of the decode kernel (d = 128) can be resident at once on this GPU
(cuOccupancyMaxActiveClusters), for cluster sizes 8 and 16 (16 is non-portable) at the kernel's own dynamic
shared memory (two blocks fit per SM) and at 120 KB (one block per SM): whether 8 KV heads x 16 splits can
run as 8 clusters of 16 at one block per SM, the precondition of a split merge through distributed shared
memory."""
import ctypes

from cuflash import _jit, decode

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


class ClusterDim(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class Value(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("clusterDim", ClusterDim)]


class Attribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", Value)]


class Config(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(Attribute)), ("numAttrs", ctypes.c_uint)]


def main():
    lib = ctypes.CDLL("libcuda.so.1")
    variant = decode.fwd_variant(128, "bfloat16", False)
    fn = ctypes.c_void_p(_jit.get_function(variant).ptr)
    print(lib.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
          lib.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 200 * 1024), "(set attributes)")
    for size in (8, 16):
        for smem in (variant.smem_bytes, 120 * 1024):
            attr = Attribute(id=CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
            attr.value.clusterDim = ClusterDim(size, 1, 1)
            config = Config(16 * size, 8, 1, variant.threads, 1, 1, smem, None, ctypes.pointer(attr), 1)
            n = ctypes.c_int(-1)
            err = lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), fn, ctypes.byref(config))
            print(f"cluster {size:2d}, {smem // 1024} KB smem per block: max active clusters {n.value} (err {err})")


if __name__ == "__main__":
    main()
