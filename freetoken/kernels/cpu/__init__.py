"""Numba CPU kernels: SwiGLU experts over the bf16 host banks, and bandwidth probes.

Importing this package selects Numba's omp threading layer (see `bandwidth`), so import it
before any other parallel Numba code runs.
"""

from freetoken.kernels.cpu.bandwidth import configure_threading

configure_threading()
