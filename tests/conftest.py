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
