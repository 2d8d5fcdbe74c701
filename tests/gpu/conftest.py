"""tests/gpu needs CUDA: without it nothing here is collected (the rest of the suite still runs)."""

import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]
