"""tests/gpu needs CUDA: without it nothing here is collected (the rest of the suite still runs).

Tests marked `device_memory` read the device's free memory (`torch.cuda.mem_get_info`), which
other processes change: under pytest-xdist's workers they are skipped, and run on their own with

    python -m pytest tests/gpu -m device_memory
"""

import os

import pytest
import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]


def pytest_configure(config):
    config.addinivalue_line("markers", "device_memory: reads the device's free memory; run without parallel workers")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return
    skip = pytest.mark.skip(reason="reads the device's free memory, which the other workers change: "
                                   "run `pytest tests/gpu -m device_memory` on its own")
    for item in items:
        if item.get_closest_marker("device_memory"):
            item.add_marker(skip)
