import pytest
import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]


def pytest_collection_modifyitems(items):
    if not torch.cuda.is_available():
        for item in items:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
