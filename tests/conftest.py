"""Test tiers: everything runs on a CPU-only machine except tests marked `gpu`, which skip there."""
import pytest

from cuflash._device import has_gpu


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_plans():
    """Each test plans its calls afresh: tests edit cuflash.heuristics' tables and patch planning functions,
    which memoised checks and plans (cuflash.clear_plans) would otherwise outlive."""
    import cuflash

    cuflash.clear_plans()
    yield
    cuflash.clear_plans()


@pytest.fixture
def poison_allocations():
    """Every CuPy allocation inside the test starts as NaN bytes (0xFF..), so an output element the
    kernel never writes fails the comparison instead of passing as a lucky zero."""
    import cupy

    pool = cupy.cuda.MemoryPool()

    def poisoned_malloc(size):
        mem = pool.malloc(size)
        if size:
            cupy.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cupy.cuda.get_current_stream().ptr)
        return mem

    cupy.cuda.set_allocator(poisoned_malloc)
    try:
        yield
    finally:
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
        pool.free_all_blocks()
