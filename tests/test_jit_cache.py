"""CPU tier: the NVRTC compile cache (hit, memo, corrupt/truncated entries, concurrent compiles, header
invalidation, unwritable directory)."""
import multiprocessing
import os
import shutil
import stat
import warnings

import pytest

from cuflash import _jit

ARCH = "sm_80"


def _variant(src="common/bwd_aux.cu", kernel="bwd_convert_dq", d=64):
    return _jit.Variant("bwd_aux", src, kernel, (("CUFLASH_HEADDIM", d), ("CUFLASH_DTYPE", 0)))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "cache"))
    _jit.clear_memo()
    yield tmp_path / "cache"
    _jit.clear_memo()


def _entries(cache):
    return sorted(p for p in cache.glob("*.cubin"))


def test_compile_writes_one_entry_and_memo_skips_io(cache, monkeypatch):
    v = _variant()
    first = _jit.compile_variant(v, ARCH)
    assert first.cubin.startswith(b"\x7fELF")
    assert len(_entries(cache)) == 1
    # A second call is served from memory: no NVRTC, no file reads.
    monkeypatch.setattr(_jit, "_nvrtc_compile", lambda *a: pytest.fail("recompiled"))
    monkeypatch.setattr(_jit, "_read_entry", lambda *a: pytest.fail("read the disk"))
    assert _jit.compile_variant(v, ARCH) is first


def test_disk_hit_after_memo_cleared(cache, monkeypatch):
    v = _variant()
    cubin = _jit.compile_variant(v, ARCH).cubin
    _jit.clear_memo()
    monkeypatch.setattr(_jit, "_nvrtc_compile", lambda *a: pytest.fail("recompiled despite a valid entry"))
    assert _jit.compile_variant(v, ARCH).cubin == cubin


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_corrupt_entry_is_recompiled(cache, damage):
    v = _variant()
    good = _jit.compile_variant(v, ARCH).cubin
    (entry,) = _entries(cache)
    blob = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        entry.write_bytes(blob[:-10] + bytes([blob[-10] ^ 0xFF]) + blob[-9:])
    elif damage == "garbage":
        entry.write_bytes(os.urandom(len(blob)))
    else:
        entry.write_bytes(b"")
    _jit.clear_memo()
    again = _jit.compile_variant(v, ARCH)
    assert again.cubin == good
    assert _jit._read_entry(entry) is not None  # rewritten whole


def _compile_in_child(cache_dir, queue):
    os.environ["CUFLASH_CACHE_DIR"] = cache_dir
    from cuflash import _jit as jit

    queue.put(jit.compile_variant(_variant(d=128), ARCH).cubin)


def test_two_processes_compile_the_same_variant(cache):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_compile_in_child, args=(str(cache), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1]
    entries = _entries(cache)
    assert len(entries) == 1 and _jit._read_entry(entries[0]) is not None
    assert not list(cache.glob("*.tmp"))


def test_changed_header_invalidates(cache, tmp_path, monkeypatch):
    """The key hashes every included header: editing one gives a new entry."""
    src = tmp_path / "kernels_cu"
    shutil.copytree(_jit.kernels_dir(), src)
    monkeypatch.setattr(_jit, "kernels_dir", lambda: src)
    v = _variant()
    key1 = _jit.cache_key(v, ARCH)
    _jit.compile_variant(v, ARCH)
    types = src / "common" / "types.cuh"
    types.write_text(types.read_text() + "\n// touched\n")
    key2 = _jit.cache_key(v, ARCH)
    assert key1 != key2
    _jit.clear_memo()
    _jit.compile_variant(v, ARCH)
    assert len(_entries(cache)) == 2


def test_unwritable_cache_falls_back_to_memory_with_one_warning(tmp_path, monkeypatch):
    if os.geteuid() == 0:
        # root ignores directory permissions; a path under a regular file cannot be created by anyone
        blocker = tmp_path / "file"
        blocker.write_text("x")
        target = blocker / "cache"
    else:
        target = tmp_path / "ro"
        target.mkdir()
        target.chmod(stat.S_IRUSR | stat.S_IXUSR)
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(target))
    monkeypatch.setattr(_jit, "_warned_unwritable", False)
    _jit.clear_memo()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = _jit.compile_variant(_variant(d=32), ARCH)
        b = _jit.compile_variant(_variant(d=96), ARCH)
    assert a.cubin.startswith(b"\x7fELF") and b.cubin.startswith(b"\x7fELF")
    msgs = [w for w in caught if "compile cache" in str(w.message)]
    assert len(msgs) == 1
    _jit.clear_memo()


def test_sources_ship_with_the_package():
    root = _jit.kernels_dir()
    assert (root / "common" / "types.cuh").is_file()
    assert (root / "fa1" / "fwd.cu").is_file()


def test_launch_passes_numpy_structs_by_pointer(monkeypatch):
    """_jit.launch hands numpy struct arguments to CuPy as raw pointers to their bytes (CuPy's own
    conversion costs ~10 µs per struct argument) and takes block and shared memory from the variant."""
    import numpy as np
    from cupy.cuda.function import CPointer

    from cuflash import _jit

    seen = {}

    def fake_function(grid, block, args, shared_mem=0, stream=None):
        seen.update(grid=grid, block=block, args=args, shared_mem=shared_mem, stream=stream)

    monkeypatch.setattr(_jit, "get_function", lambda variant: fake_function)
    variant = _jit.Variant("fa1", "fa1/fwd.cu", "fa1_fwd", (), threads=256, smem_bytes=4096)
    params = np.zeros(1, np.dtype([("a", np.int64), ("b", np.float32)], align=True))
    _jit.launch(variant, (3, 2), (params, 7), "stream")
    assert seen["grid"] == (3, 2) and seen["block"] == (256,) and seen["shared_mem"] == 4096
    assert seen["stream"] == "stream" and seen["args"][1] == 7
    assert isinstance(seen["args"][0], CPointer)


def test_cache_pack_names_the_entries_the_package_reads_and_leaves_the_tables_alone(cache):
    """scripts/cache_pack.py packs _jit.entry_path's files (where compile_variant looks) and lists the
    probes' variants by editing the heuristics tables, which it must restore."""
    import copy
    import sys
    from pathlib import Path

    from cuflash import compile_report, heuristics

    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    import cache_pack

    names = ("FA2_TILES", "FA2_TILES_SM90", "FA2_BWD_TILES", "FA2_BWD_TILES_PLAIN", "FA2_BWD_TILES_PLAIN_SM90")
    tables = {name: copy.deepcopy(getattr(heuristics, name)) for name in names}
    extra = cache_pack.probe_variants()
    assert {name: getattr(heuristics, name) for name in names} == tables
    assert len(set(extra) - set(compile_report.all_variants("sm_90a"))) > 20  # beyond the tables

    v = _variant()
    path = _jit.entry_path(v, ARCH)
    assert path.parent == cache
    cache.mkdir()
    _jit._write_entry_atomically(path, _jit._encode_entry(b"cubin", "log"))
    assert _jit.compile_variant(v, ARCH).cubin == b"cubin"  # found where entry_path said
