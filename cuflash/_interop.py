"""Arrays in and out: CuPy arrays or anything with ``__dlpack__`` (torch, JAX), zero-copy.

``Call`` turns a call's array arguments into CuPy arrays, remembers the framework of the first one so
results go back in it, and makes the caller's current stream CuPy's current stream for the duration
of the call (torch's current stream for torch inputs), so kernels are ordered with the caller's work.
Nothing is copied: strides are passed to the kernels as they are.
"""
from __future__ import annotations

import dataclasses

_KDL_CUDA = 2  # DLPack device type of CUDA device memory
_KDL_CUDA_MANAGED = 13


@dataclasses.dataclass(frozen=True)
class Spec:
    """What validation needs to know of an array; buildable without a GPU (tests do)."""

    name: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str  # numpy dtype name: "bfloat16", "float16", "float32", "int32", ...
    device: int
    ptr: int

    @classmethod
    def of(cls, name: str, a) -> "Spec":
        dt = a.dtype
        item = dt.itemsize
        return cls(name, a.shape, tuple(s // item for s in a.strides), dtype_name(dt), a.device.id, a.data.ptr)


_DTYPE_NAMES: dict = {}


def dtype_name(dt) -> str:
    """``str(dt)`` ("bfloat16", "float16", ...), memoised: numpy builds the string in Python each time."""
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = str(dt)
    return name


def framework_of(x) -> str:
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":
        return "cupy"
    if mod == "torch":
        return "torch"
    if mod in ("jax", "jaxlib"):
        return "jax"
    return "dlpack"


def _refuse_host_memory(name: str, x) -> None:
    import cupy

    if isinstance(x, cupy.ndarray):
        return
    if not hasattr(x, "__dlpack__"):
        raise TypeError(
            f"{name} must be a GPU array (a CuPy array, or a torch/JAX array on a CUDA device); "
            f"got {type(x).__module__}.{type(x).__name__}"
        )
    try:
        dev_type, _ = x.__dlpack_device__()
    except Exception as exc:  # pragma: no cover - exotic producers
        raise TypeError(f"{name}: cannot tell which device holds it ({exc})") from None
    if dev_type not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        raise TypeError(
            f"{name} must live in CUDA device memory; got a {type(x).__module__}.{type(x).__name__} in host "
            f"memory (DLPack device type {int(dev_type)}). Move it to the GPU first (e.g. .cuda(), "
            "cupy.asarray, jax.device_put)."
        )


def _exportable(x):
    """``x`` ready for DLPack export. torch refuses to export a tensor that requires grad; the plain API
    is not differentiable (cuflash.torch is), so it reads such a tensor's data through a detached view."""
    if getattr(x, "requires_grad", False) and hasattr(x, "detach"):
        return x.detach()
    return x


def _caller_stream(framework: str, x):
    """The stream the caller's framework is issuing work on, as a CuPy stream."""
    import cupy

    if framework == "torch":
        import torch

        s = torch.cuda.current_stream(x.device)
        return cupy.cuda.ExternalStream(s.cuda_stream, x.device.index)
    return cupy.cuda.get_current_stream()


class Call:
    """Context for one public call: converts inputs, sets the stream, converts outputs back.

    ``layout``: what the checks of a call read of its arrays -- each one's shape, strides, dtype, device and
    whether its data is 16-byte aligned -- as a hashable key (built when asked for), so that a call like one
    checked before can skip its checks (cuflash.api); stand-ins without real arrays set it to None (never
    memoised).
    ``specs``: the arrays' Spec records, built on first use.
    """

    def __init__(self, named_arrays: list[tuple[str, object]]):
        import cupy

        for name, x in named_arrays:
            _refuse_host_memory(name, x)
        first = named_arrays[0][1]
        self.framework = framework_of(first)
        self.stream = _caller_stream(self.framework, first)
        self._first = first
        self._names = [name for name, _ in named_arrays]
        device = first.device.id if isinstance(first, cupy.ndarray) else int(first.__dlpack_device__()[1])
        self.device = cupy.cuda.Device(device)
        if all(isinstance(x, cupy.ndarray) for _, x in named_arrays):
            self.arrays = [x for _, x in named_arrays]
        else:
            with self.device, self.stream:
                self.arrays = [x if isinstance(x, cupy.ndarray) else cupy.from_dlpack(_exportable(x))
                               for _, x in named_arrays]
        self._specs = None

    @property
    def layout(self) -> tuple:
        return tuple((a.shape, a.strides, a.dtype, a.data.device_id, a.data.ptr % 16) for a in self.arrays)

    @property
    def specs(self) -> list[Spec]:
        if self._specs is None:
            self._specs = [Spec.of(name, a) for name, a in zip(self._names, self.arrays)]
        return self._specs

    def __enter__(self) -> "Call":
        self.device.__enter__()
        self.stream.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.stream.__exit__(*exc)
        self.device.__exit__(*exc)

    def wrap(self, a):
        """A CuPy result as an array of the caller's framework (zero-copy)."""
        if self.framework == "torch":
            import torch

            return torch.from_dlpack(a)
        if self.framework == "jax":
            import jax.numpy as jnp

            return jnp.from_dlpack(a)
        return a
