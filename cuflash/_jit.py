"""Variant key -> NVRTC compile -> on-disk cubin cache -> loaded CUDA function.

A kernel *variant* is a small frozen key (family, source file, kernel name, compile-time constants).
Its constants become ``-D`` defines here and nowhere else. Compiling needs no GPU: NVRTC through
``cupy.cuda.nvrtc`` produces a cubin for any arch (``sm_90a`` for the Hopper-only instructions).

Cache: ``$CUFLASH_CACHE_DIR`` (default ``~/.cache/cuflash``), one file per variant and arch, keyed by
the hash of the source with every header it includes, the options, the arch, the NVRTC version and the
cuflash version. Entries are written atomically (temp file + rename) under a file lock, carry a hash
of their payload, and an unreadable or truncated entry is recompiled. An in-process memo makes the
second call of a variant do no file I/O. If the cache directory cannot be written, cubins are kept in
memory only, with one warning.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import re
import struct
import tempfile
import threading
import warnings
from pathlib import Path

from . import __version__

_MAGIC = b"CUFLASH-CUBIN-1\n"
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


class CompileError(RuntimeError):
    """NVRTC rejected a kernel variant; the message names the variant and carries the NVRTC log."""


def kernels_dir() -> Path:
    """The CUDA sources: inside the installed package, or at the top of a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels_cu", here.parent / "kernels_cu"):
        if (candidate / "common").is_dir():
            return candidate
    raise FileNotFoundError(f"cuflash: CUDA sources (kernels_cu/) not found next to {here}")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled kernel: ``source`` (relative to kernels_cu/, or an absolute path) built with ``defines``.

    ``kernel`` is the ``extern "C"`` entry point. ``threads`` and ``smem_bytes`` (dynamic shared
    memory) describe the launch the variant was built for; they are part of what the compile report
    prints and what the launcher asks the driver for.
    """

    family: str
    source: str
    kernel: str
    defines: tuple[tuple[str, int | str], ...] = ()
    threads: int = 128
    smem_bytes: int = 0

    @property
    def name(self) -> str:
        consts = ",".join(f"{k.removeprefix('CUFLASH_').lower()}={v}" for k, v in self.defines)
        return f"{self.family}.{self.kernel}[{consts}]"

    def options(self, arch: str) -> list[str]:
        opts = [
            f"-arch={arch}",
            "-std=c++17",
            "-default-device",
            "--ptxas-options=-v",
            "-lineinfo",
            f"-I{kernels_dir()}",
            f"-DCUFLASH_THREADS={self.threads}",
        ]
        opts += [f"-D{k}={v}" for k, v in self.defines]
        return opts


@dataclasses.dataclass(frozen=True)
class Compiled:
    variant: Variant
    arch: str
    cubin: bytes
    log: str  # NVRTC/ptxas log (registers, spills, advisories)


# ---------------------------------------------------------------------------------------------
# source hashing


def _source_closure(path: Path, seen: dict[Path, str] | None = None) -> dict[Path, str]:
    """The file and every local header it includes, recursively, as {path: text}."""
    seen = {} if seen is None else seen
    path = path.resolve()
    if path in seen:
        return seen
    text = path.read_text()
    seen[path] = text
    for inc in _INCLUDE_RE.findall(text):
        for base in (path.parent, kernels_dir()):
            candidate = base / inc
            if candidate.is_file():
                _source_closure(candidate, seen)
                break
    return seen


def nvrtc_version() -> tuple[int, int]:
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getVersion())


def cache_key(variant: Variant, arch: str) -> str:
    root = kernels_dir()
    closure = _source_closure(root / variant.source)
    h = hashlib.sha256()
    for path in sorted(closure):
        name = path.relative_to(root) if path.is_relative_to(root) else path  # tests compile their own kernels
        h.update(str(name).encode())
        h.update(b"\0")
        h.update(closure[path].encode())
        h.update(b"\0")
    # The -I path is left out: where the sources live does not change the cubin, their text does.
    options = [o for o in variant.options(arch) if not o.startswith("-I")]
    h.update(json.dumps([variant.kernel, options, arch, nvrtc_version(), __version__]).encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# NVRTC


def _nvrtc_compile(variant: Variant, arch: str) -> tuple[bytes, str]:
    from cupy.cuda import nvrtc

    path = kernels_dir() / variant.source
    prog = nvrtc.createProgram(path.read_text(), str(path.name), [], [])
    try:
        try:
            nvrtc.compileProgram(prog, variant.options(arch))
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise CompileError(
                f"NVRTC could not compile {variant.name} for {arch}: {exc}\n{log}"
            ) from None
        return _get_cubin(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def _get_cubin(prog: int) -> bytes:
    """The cubin of a compiled NVRTC program, whole.

    ``cupy.cuda.nvrtc.getCUBIN`` (CuPy 14) drops the last byte as if it were a string terminator,
    which leaves an ELF that nvdisasm rejects; ask the library CuPy loaded directly instead.
    """
    lib = _libnvrtc()
    size = ctypes.c_size_t()
    if lib.nvrtcGetCUBINSize(ctypes.c_void_p(prog), ctypes.byref(size)) != 0:
        raise CompileError("nvrtcGetCUBINSize failed")
    buf = ctypes.create_string_buffer(size.value)
    if lib.nvrtcGetCUBIN(ctypes.c_void_p(prog), buf) != 0:
        raise CompileError("nvrtcGetCUBIN failed")
    return buf.raw


_libnvrtc_handle = None


def _libnvrtc():
    global _libnvrtc_handle
    if _libnvrtc_handle is None:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()  # makes CuPy load its libnvrtc
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libnvrtc.so" in line})
        if not paths:
            raise CompileError("cannot find the libnvrtc that CuPy loaded")
        _libnvrtc_handle = ctypes.CDLL(paths[0])
    return _libnvrtc_handle


# ---------------------------------------------------------------------------------------------
# disk cache


def cache_dir() -> Path:
    return Path(os.environ.get("CUFLASH_CACHE_DIR") or Path.home() / ".cache" / "cuflash")


def _encode_entry(cubin: bytes, log: str) -> bytes:
    meta = json.dumps({"sha256": hashlib.sha256(cubin).hexdigest(), "size": len(cubin), "log": log})
    meta_b = meta.encode()
    return _MAGIC + len(meta_b).to_bytes(8, "little") + meta_b + cubin


def _decode_entry(blob: bytes) -> tuple[bytes, str] | None:
    """(cubin, log), or None when the entry is truncated, corrupt or from another format."""
    try:
        if not blob.startswith(_MAGIC):
            return None
        off = len(_MAGIC)
        n = int.from_bytes(blob[off : off + 8], "little")
        meta = json.loads(blob[off + 8 : off + 8 + n])
        cubin = blob[off + 8 + n :]
        if len(cubin) != meta["size"] or hashlib.sha256(cubin).hexdigest() != meta["sha256"]:
            return None
        return cubin, meta["log"]
    except (ValueError, KeyError, UnicodeDecodeError):
        return None


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl

    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read_entry(path: Path) -> tuple[bytes, str] | None:
    try:
        return _decode_entry(path.read_bytes())
    except OSError:
        return None


def _write_entry_atomically(path: Path, blob: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(blob)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_memo: dict[tuple[Variant, str], Compiled] = {}
_memo_lock = threading.Lock()
_warned_unwritable = False


def _warn_unwritable(directory: Path, exc: Exception) -> None:
    global _warned_unwritable
    if not _warned_unwritable:
        _warned_unwritable = True
        warnings.warn(
            f"cuflash: cannot write the compile cache at {directory} ({exc}); "
            "compiled kernels are kept in memory for this process only. "
            "Set CUFLASH_CACHE_DIR to a writable directory.",
            RuntimeWarning,
            stacklevel=3,
        )


def compile_variant(variant: Variant, arch: str) -> Compiled:
    """The compiled cubin of ``variant`` for ``arch``: from memory, from disk, or from NVRTC."""
    memo_key = (variant, arch)
    hit = _memo.get(memo_key)
    if hit is not None:
        return hit
    with _memo_lock:
        hit = _memo.get(memo_key)
        if hit is not None:
            return hit
        compiled = _compile_through_disk_cache(variant, arch)
        _memo[memo_key] = compiled
        return compiled


def entry_path(variant: Variant, arch: str) -> Path:
    """Where the disk cache keeps this variant's entry for this arch."""
    key = cache_key(variant, arch)
    return cache_dir() / f"{variant.family}-{variant.kernel}-{arch}-{key[:40]}.cubin"


def _compile_through_disk_cache(variant: Variant, arch: str) -> Compiled:
    path = entry_path(variant, arch)
    directory = path.parent
    entry = _read_entry(path)
    if entry is not None:
        return Compiled(variant, arch, *entry)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with _file_lock(directory / (path.name + ".lock")):
            entry = _read_entry(path)  # another process may have compiled it while we waited
            if entry is None:
                entry = _nvrtc_compile(variant, arch)
                _write_entry_atomically(path, _encode_entry(*entry))
    except OSError as exc:  # read-only or missing cache directory: memory only
        _warn_unwritable(directory, exc)
        entry = _nvrtc_compile(variant, arch)
    return Compiled(variant, arch, *entry)


def clear_memo() -> None:
    """Forget in-process results (tests use this to exercise the disk cache)."""
    _memo.clear()
    _loaded.clear()


# ---------------------------------------------------------------------------------------------
# loading onto the current device

_loaded: dict[tuple[Variant, int], object] = {}


def _check_smem(variant: Variant, fn, dev: int) -> None:
    """A clear error where ``variant`` needs more shared memory per block than the device has (the tables
    choose tiles that fit each arch: _device.ARCH_SMEM_PER_BLOCK; this guards the rest)."""
    from cupy_backends.cuda.api import driver

    from ._device import arch_for_device, max_smem_per_block

    static = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn.ptr)
    limit = max_smem_per_block(dev)
    if variant.smem_bytes + static > limit:
        raise RuntimeError(f"kernel {variant.name} needs {variant.smem_bytes + static} bytes of shared memory per "
                           f"thread block; this GPU ({arch_for_device(dev)}) allows {limit}")


def get_function(variant: Variant):
    """The ``cupy.cuda.function.Function`` of ``variant`` on the current device, ready to launch."""
    import cupy
    from cupy_backends.cuda.api import driver

    from ._device import arch_for_device, device_id

    dev = device_id()
    fn = _loaded.get((variant, dev))
    if fn is not None:
        return fn
    compiled = compile_variant(variant, arch_for_device(dev))
    module = cupy.cuda.function.Module()
    module.load(compiled.cubin)
    fn = module.get_function(variant.kernel)  # the Function holds a reference to its module
    _check_smem(variant, fn, dev)
    if variant.smem_bytes > 48 * 1024:
        driver.funcSetAttribute(
            fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, variant.smem_bytes
        )
    _loaded[(variant, dev)] = fn
    return fn


def launch(variant: Variant, grid: tuple[int, ...], args, stream) -> None:
    """Launch ``variant`` on ``stream`` with ``variant.threads`` threads and ``variant.smem_bytes`` of
    dynamic shared memory.

    numpy structured arrays (params structs, tensor maps) are passed by pointer: CuPy's own conversion
    of such an argument builds its full type description, ~10 µs of Python per argument per launch.
    The driver copies each parameter when the launch is issued, so the arrays only live until then.
    """
    import numpy
    from cupy.cuda.function import CPointer

    fn = get_function(variant)
    ptrs = [CPointer(a.ctypes.data) if isinstance(a, numpy.ndarray) else a for a in args]
    fn(grid, (variant.threads,), ptrs, shared_mem=variant.smem_bytes, stream=stream)


# ---------------------------------------------------------------------------------------------
# programmatic dependent launch (sm_90+)
#
# CuPy launches through cuLaunchKernel, which takes no launch attributes, so this one launch goes to the
# driver's cuLaunchKernelEx through ctypes. Mirrors of cuda.h (CUDA 12 / 13, 64-bit; sizes and offsets
# pinned in tests/test_launch_dependent.py). Only the one attribute value used here is named in the
# union. In C the union is 8-byte aligned (other members hold pointers) and cuda.h pads the 4-byte id to
# 8 for it; the same explicit pad puts the value at offset 8 here, so an attribute is 72 bytes either way.

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class CUlaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("programmaticStreamSerializationAllowed", ctypes.c_int)]


class CUlaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", CUlaunchAttributeValue)]


class CUlaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(CUlaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_libcuda_handle = None


def _libcuda():
    """The CUDA driver (the library CuPy's runtime already uses), with the entry points used here typed."""
    global _libcuda_handle
    if _libcuda_handle is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        lib.cuLaunchKernel.restype = ctypes.c_int
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(CUlaunchConfig), ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuGetErrorName.restype = ctypes.c_int
        _libcuda_handle = lib
    return _libcuda_handle


_pdl_attribute_pointer = None


def _pdl_attribute():
    """A pointer to the one launch attribute launch_dependent passes (built once: the driver only reads it)."""
    global _pdl_attribute_pointer
    if _pdl_attribute_pointer is None:
        attr = CUlaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value.programmaticStreamSerializationAllowed = 1
        _pdl_attribute_pointer = ctypes.pointer(attr)  # (the pointer keeps the structure alive)
    return _pdl_attribute_pointer


def launch_dependent(variant: Variant, grid: tuple[int, ...], args, stream) -> None:
    """Launch ``variant`` like :func:`launch`, as the programmatic dependent of the kernel launched before
    it on ``stream`` (the programmatic-stream-serialisation attribute): its blocks may start once every
    block of that kernel has executed ``griddepcontrol.launch_dependents`` (or exited), so its launch
    overlaps that kernel's run; it must execute ``griddepcontrol.wait`` (grid_dependency_wait() in
    common/ptx.cuh) before it reads anything that kernel writes. Under stream capture this becomes a
    programmatic edge of the graph.

    ``args`` are numpy arrays (params structs), passed by pointer like :func:`launch` does. Below sm_90,
    which has no griddepcontrol, this is :func:`launch`.
    """
    import numpy

    from ._device import compute_capability, device_id

    if compute_capability(device_id()) < (9, 0):
        launch(variant, grid, args, stream)
        return
    if not all(isinstance(a, numpy.ndarray) for a in args):
        raise TypeError("launch_dependent takes numpy arrays (params structs) as kernel arguments")
    fn = get_function(variant)
    if stream is None:
        import cupy

        stream = cupy.cuda.get_current_stream()
    config = launch_config(variant, grid, dependent=True)
    config.hStream = stream.ptr
    params = (ctypes.c_void_p * len(args))(*(a.ctypes.data for a in args))
    launch_ex(variant.name, fn.ptr, config, params)


def launch_config(variant: Variant, grid: tuple[int, ...], dependent: bool = False) -> CUlaunchConfig:
    """cuLaunchKernelEx's configuration of ``variant`` over ``grid`` (its hStream is the caller's to set);
    ``dependent``: with the programmatic-stream-serialisation attribute (launch_dependent)."""
    gx, gy, gz = (tuple(grid) + (1, 1))[:3]
    return CUlaunchConfig(gx, gy, gz, variant.threads, 1, 1, variant.smem_bytes, None,
                          _pdl_attribute() if dependent else None, int(dependent))


_U64 = struct.Struct("<Q")


class PreparedLaunch:
    """One kernel's launch with everything fixed when a call's shapes are planned but a few 64-bit fields of
    its params struct (pointers, a tag) and the addresses of its tensor maps, set per call.

    A call copies the struct's bytes, packs those fields into the copy and issues cuLaunchKernel through
    ctypes: a few microseconds of Python, where filling a numpy struct field by field and CuPy's launch
    with numpy-struct arguments cost tens (scripts/host_overhead.py). The driver copies the arguments when
    the launch is issued, so the copy only lives until then. Built on the device it launches on.
    """

    def __init__(self, variant: Variant, grid: tuple[int, ...], params, per_call: tuple[str, ...]):
        self.variant = variant
        self.function = get_function(variant)  # (holds its module)
        self.grid = (tuple(grid) + (1, 1))[:3]
        self.template = params.tobytes()
        self.offsets = tuple(params.dtype.fields[name][1] for name in per_call)
        for name in per_call:
            if params.dtype.fields[name][0].itemsize != 8:
                raise TypeError(f"per-call field {name} of {variant.name}'s params is not 64-bit")

    def __call__(self, maps: list[int], values: list[int], stream) -> None:
        """Launch on ``stream`` with the tensor maps at host addresses ``maps`` (kept alive by the caller
        until this returns) before the params struct, whose per-call fields get ``values``."""
        struct_bytes = bytearray(self.template)
        for offset, value in zip(self.offsets, values):
            _U64.pack_into(struct_bytes, offset, value)
        arg = (ctypes.c_char * len(struct_bytes)).from_buffer(struct_bytes)
        args = (ctypes.c_void_p * (len(maps) + 1))(*maps, ctypes.addressof(arg))
        v = self.variant
        err = _libcuda().cuLaunchKernel(self.function.ptr, *self.grid, v.threads, 1, 1, v.smem_bytes, stream.ptr,
                                        args, None)
        if err:
            raise RuntimeError(f"cuLaunchKernel of {v.name} failed: {_error_name(err)} ({err})")


def _error_name(err: int) -> str:
    text = ctypes.c_char_p()
    _libcuda().cuGetErrorName(err, ctypes.byref(text))
    return (text.value or b"unknown CUresult").decode()


def launch_ex(name: str, fn_ptr: int, config: CUlaunchConfig, params) -> None:
    """cuLaunchKernelEx of the function ``fn_ptr`` (``name`` for the error) with ``config`` and ``params``
    (a ctypes array of pointers to each kernel argument); a RuntimeError naming the driver's error."""
    err = _libcuda().cuLaunchKernelEx(ctypes.byref(config), fn_ptr, params, None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx of {name} failed: {_error_name(err)} ({err})")
