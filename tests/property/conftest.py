"""Kernels run in Triton's interpreter where there is no GPU.

The switch must be set before the first `@triton.jit` runs, i.e. before any kernel module is
imported, hence at conftest import time.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
