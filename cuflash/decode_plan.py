"""Decode steps worked out once and re-issued cheaply: ``cuflash.plan_kvcache`` and ``DecodePlan.run``.

An eager ``flash_attn_with_kvcache`` call spends most of its time in Python (about 200 us on the H200's
host against ~40 us of GPU time at 1 x 32k keys): it converts and validates every array, picks the split
count and kernel variants and fills the parameter structs anew at each call. A serving loop calls it
with the same shapes step after step. ``plan_kvcache`` makes one such call (check=False, so no device value
is read on the host) while recording its kernel launches (decode.recorded_launches); ``DecodePlan.run``
checks that its arrays have the planned shapes, strides, dtypes, device and 16-byte alignment, writes their
addresses into copies of the recorded parameter structs and issues the same launches through the driver
(cuLaunchKernelEx) on the caller's current stream: no allocation, no host synchronisation, so a run can be
captured in a CUDA graph like the call it replaces.

A plan owns its scratch (the workspace of the planned call) unless one is given, so two runs of one plan
must not be in flight on different streams at once, and one plan must not be run from two threads at once
(the parameter buffers are rewritten at each run). Make a plan per stream, or per thread.
"""
from __future__ import annotations

import ctypes
import struct

import numpy as np

from . import _device, _interop, _jit, decode

# The arrays a decode call may take, in flash_attn_with_kvcache's order (run() takes the planned subset).
ARRAY_NAMES = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "page_table", "cache_batch_idx", "rotary_cos",
               "rotary_sin", "out")
_U64 = struct.Struct("<Q")


def _layout_of(x, native: bool):
    """(address, (shape, strides, dtype, device)) of an array: of a CuPy array or a torch tensor read
    directly when ``native``; otherwise of its CuPy view through DLPack (a plan made on other arrays, or on
    a mix of kinds, reads every array so)."""
    module = type(x).__module__.split(".")[0]
    if native and module == "torch":
        return x.data_ptr(), (tuple(x.shape), x.stride(), x.dtype, x.device)
    if module != "cupy":
        import cupy

        x = cupy.from_dlpack(_interop._exportable(x))
    return x.data.ptr, (x.shape, x.strides, x.dtype, x.device.id)


class _Launch:
    """One recorded launch: the function, its configuration and its parameter struct as bytes in a ctypes
    buffer, with the offsets of the pointer fields that take a run's addresses."""

    def __init__(self, variant, grid, params: np.ndarray, dependent: bool, relocations: list[tuple[int, str]],
                 fn_ptr: int):
        self.name = variant.name
        self.fn_ptr = fn_ptr
        self.config = _jit.launch_config(variant, grid, dependent)
        self.buffer = (ctypes.c_char * params.nbytes).from_buffer_copy(params.tobytes())
        self.params = (ctypes.c_void_p * 1)(ctypes.addressof(self.buffer))
        self.relocations = relocations  # (byte offset in the struct, array name)


def relocations(params: np.ndarray, addresses: dict[str, int]) -> list[tuple[int, str]]:
    """The pointer fields (uint64) of the struct ``params`` that hold one of ``addresses`` (name -> address
    of each planned array), as (byte offset, name). Other pointer fields keep their value: 0 for arrays a
    call does not have, or the plan's own scratch. ``addresses`` must be distinct (checked by the caller)."""
    by_address = {a: n for n, a in addresses.items()}
    out = []
    for field, (dtype, offset) in params.dtype.fields.items():
        if dtype == np.uint64:
            name = by_address.get(int(params[field][0]))
            if name is not None:
                out.append((offset, name))
    return out


class DecodePlan:
    """The launches of one ``flash_attn_with_kvcache`` call, re-issued by :meth:`run` for arrays of the
    same layout (see the module docstring; made by :func:`plan_kvcache`)."""

    def __init__(self, framework: str, native: bool, device: int, layouts: dict, alignment: dict,
                 launches: list[_Launch], lse, keep, num_splits: int = 0):
        self.framework = framework     # q's: whose current stream a run launches on
        self.native = native           # every array CuPy, or every one torch: layouts read directly (_layout_of)
        self.device = device
        self.names = tuple(layouts)
        self._layouts = layouts        # name -> (shape, strides, dtype, device) as _layout_of reads them
        self._alignment = alignment    # name -> address % 16 at plan time
        self._launches = launches
        self._lse = lse                # the returned lse (a view into the plan's scratch) or None
        self._keep = keep              # the scratch and the functions' modules, alive as long as the plan
        self.num_splits = num_splits   # the KV split count of the planned launches (an eager call with
                                       # check=True may pick fewer for shorter caches: pass this to match)

    def run(self, q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, page_table=None, cache_batch_idx=None,
            rotary_cos=None, rotary_sin=None, out):
        """Attention of ``q`` over the cache as the planned call computes it (new k / v appended first when
        planned), into ``out``; returns ``out``, or ``(out, lse)`` when planned with return_softmax_lse
        (the same lse array at every run, overwritten). The arrays must be the planned ones' kind
        (framework), shapes, strides, dtypes and device, and start at addresses as aligned as those did;
        their contents are read on the device only (as with check=False)."""
        given = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "cache_seqlens": cache_seqlens,
                 "page_table": page_table, "cache_batch_idx": cache_batch_idx, "rotary_cos": rotary_cos,
                 "rotary_sin": rotary_sin, "out": out}
        addresses = {}
        for name in ARRAY_NAMES:
            x = given[name]
            if (x is None) != (name not in self._layouts):
                raise ValueError(f"{name}: this plan was made {'without' if x is not None else 'with'} it")
            if x is None:
                continue
            address, layout = _layout_of(x, self.native)
            if layout != self._layouts[name]:
                raise ValueError(f"{name} must have the planned shape, strides, dtype and device "
                                 f"{self._layouts[name]}; got {layout}")
            if address % 16 != self._alignment[name]:
                raise ValueError(f"{name} must start at an address as aligned as the planned one's "
                                 f"({self._alignment[name]} mod 16); got {address:#x}")
            addresses[name] = address
        if addresses["out"] == addresses["q"]:
            raise ValueError("out must not be q itself (the kernels read q while out is written)")
        self._issue(addresses, self._stream_handle(q))
        return (out, self._lse) if self._lse is not None else out

    def _stream_handle(self, q) -> int:
        """The caller's current stream on the plan's device, as a CUstream handle."""
        if self.framework == "torch":
            import torch

            return torch.cuda.current_stream(q.device).cuda_stream
        import cupy

        return cupy.cuda.get_current_stream().ptr

    def _issue(self, addresses: dict[str, int], stream: int) -> None:
        import cupy

        with cupy.cuda.Device(self.device):  # (the driver launches into the current context)
            for launch in self._launches:
                for offset, name in launch.relocations:
                    _U64.pack_into(launch.buffer, offset, addresses[name])
                launch.config.hStream = stream
                _jit.launch_ex(launch.name, launch.fn_ptr, launch.config, launch.params)


def plan_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, page_table=None, cache_batch_idx=None,
                 rotary_cos=None, rotary_sin=None, rotary_interleaved=False, softmax_scale=None, causal=False,
                 window_size=(-1, -1), softcap=0.0, num_splits=0, return_softmax_lse=False, out, workspace=None):
    """Make a :class:`DecodePlan`: runs ``flash_attn_with_kvcache`` once with these arguments (check=False:
    it computes attention into ``out`` and appends k / v, as that call would) and records its launches.
    ``plan.run(...)`` then repeats the call for arrays of the same layout at any addresses, with new
    contents (cache_seqlens, page_table, ...), for a fraction of the host time.

    ``cache_seqlens`` must be an int32 array (a Python int is filled into scratch by a separate operation
    that a plan does not repeat); ``out`` is required. ``workspace`` as in flash_attn_with_kvcache; without
    one the plan allocates and keeps its own (sized for the split count check=False picks). Every other
    argument is fixed at plan time. Errors in the arguments are raised here, as flash_attn_with_kvcache
    raises them. The plan's ``num_splits`` is the KV split count its launches use (with num_splits=0 the
    count check=False picks from the cache's capacity)."""
    import cupy

    from .api import flash_attn_with_kvcache, kvcache_num_splits, kvcache_workspace_bytes

    given = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "cache_seqlens": cache_seqlens,
             "page_table": page_table, "cache_batch_idx": cache_batch_idx, "rotary_cos": rotary_cos,
             "rotary_sin": rotary_sin, "out": out}
    if out is None:
        raise TypeError("plan_kvcache needs out= (the array each run writes)")
    if cache_seqlens is None or isinstance(cache_seqlens, (bool, int, np.integer)):
        raise TypeError("plan_kvcache needs cache_seqlens as an int32 array on the GPU (a Python int is not "
                        f"repeated by a plan); got {type(cache_seqlens).__name__}")
    with _interop.Call([(n, x) for n, x in given.items() if x is not None]) as call:
        arrays = dict(zip((s.name for s in call.specs), call.arrays))
        device = call.device.id
    frameworks = {_interop.framework_of(x) for x in given.values() if x is not None}
    native = len(frameworks) == 1 and frameworks <= {"cupy", "torch"}
    layouts, alignment, addresses = {}, {}, {}
    for name, x in given.items():
        if x is not None:
            addresses[name], layouts[name] = _layout_of(x if native else arrays[name], native)
            alignment[name] = addresses[name] % 16
    if len(set(addresses.values())) != len(addresses):
        raise ValueError("plan_kvcache needs distinct arrays (two of them start at the same address)")
    keep = []
    b, sq, h, d = arrays["q"].shape
    paged = page_table is not None
    capacity = arrays["page_table"].shape[1] * arrays["k_cache"].shape[1] if paged else arrays["k_cache"].shape[1]
    splits = num_splits or kvcache_num_splits(b, h, arrays["k_cache"].shape[2], sq, d, capacity, paged=paged,
                                              page_size=arrays["k_cache"].shape[1] if paged else None,
                                              device=device)
    if workspace is None:
        need = kvcache_workspace_bytes(b, h, sq, d, splits, dtype=str(arrays["q"].dtype),
                                       rotary=rotary_cos is not None)
        with cupy.cuda.Device(device):
            workspace = cupy.empty(max(need, 16), dtype=cupy.uint8)
        keep.append(workspace)
    recorded = []
    token = decode.recorded_launches.set(recorded)
    try:
        result = flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, page_table=page_table,
            cache_batch_idx=cache_batch_idx, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            rotary_interleaved=rotary_interleaved, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, softcap=softcap, num_splits=num_splits, return_softmax_lse=return_softmax_lse,
            check=False, out=out, workspace=workspace)
    finally:
        decode.recorded_launches.reset(token)
    programmatic = _device.compute_capability(device) >= (9, 0)  # (as launch_dependent: below sm_90 a plain launch)
    launches = []
    with cupy.cuda.Device(device):
        for variant, grid, params, dependent in recorded:
            fn = _jit.get_function(variant)
            keep.append(fn)
            launches.append(_Launch(variant, grid, params, dependent and programmatic, relocations(params, addresses),
                                    fn.ptr))
    lse = result[1] if return_softmax_lse else None
    return DecodePlan(_interop.framework_of(q), native, device, layouts, alignment, launches, lse, keep, splits)
