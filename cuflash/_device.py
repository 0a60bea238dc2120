"""What GPU (if any) this process sees: presence, compute capability, the arch string NVRTC wants."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def has_gpu() -> bool:
    """True when a CUDA driver and at least one device are present."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device, or CuPy missing
        return False


def device_id() -> int:
    """The current CUDA device (cupy.cuda.Device().id without building a Device object)."""
    from cupy_backends.cuda.api import runtime

    return runtime.getDevice()


@functools.lru_cache(maxsize=None)
def compute_capability(device: int = 0) -> tuple[int, int]:
    import cupy

    cc = cupy.cuda.Device(device).compute_capability  # e.g. "90"
    return int(cc[:-1]), int(cc[-1])


def arch_for_device(device: int = 0) -> str:
    """NVRTC arch of a device; Hopper gets the arch-specific "a" target so wgmma/setmaxnreg compile."""
    major, minor = compute_capability(device)
    suffix = "a" if (major, minor) == (9, 0) else ""
    return f"sm_{major}{minor}{suffix}"


@functools.lru_cache(maxsize=None)
def device_properties(device: int = 0) -> dict:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device)


# Shared memory one thread block may take (dynamic + static, with the opt-in attribute), by arch: what a
# kernel family's tiles must fit (the compile check uses these; at run time the device's own value counts).
ARCH_SMEM_PER_BLOCK = {"sm_80": 166912, "sm_86": 101376, "sm_87": 166912, "sm_89": 101376, "sm_90": 232448,
                       "sm_90a": 232448, "sm_100": 232448, "sm_120": 101376}


def max_smem_per_block(device: int = 0) -> int:
    """Bytes of shared memory a block of this device may use (cudaDevAttrMaxSharedMemoryPerBlockOptin)."""
    return int(device_properties(device)["sharedMemPerBlockOptin"])
