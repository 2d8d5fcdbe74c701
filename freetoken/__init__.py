"""freetoken: an MoE serving engine for one GPU whose memory cannot hold every expert."""

import os

# torch's intra-op threads and the Numba CPU kernels share one OpenMP runtime (libgomp), whose
# idle threads spin for about 3 ms after every parallel region by default. On a machine with
# other work running, a region's member that lost its core then waits behind its spinning
# siblings, region after region, and decode slows far beyond the cores taken. A short spin
# (libgomp counts roughly 100 spins a microsecond), then sleep, lets the scheduler hand it a
# sibling's core at once. The runtime reads this when it loads (with torch), so it is set before
# anything imports torch; a wait policy the user chose is left alone.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
