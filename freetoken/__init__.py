"""freetoken: an MoE serving engine for one GPU whose memory cannot hold every expert."""

import os

# torch's intra-op threads and the Numba CPU kernels share one OpenMP runtime (libgomp), whose
# idle threads keep spinning for a while after every parallel region by default. On a machine with
# other work running, a region's member that lost its core then waits behind its spinning
# siblings for the scheduler's next turn, region after region, and decode slows far beyond the
# cores taken. Idle threads that sleep instead leave their cores free, and a woken member is
# scheduled at once. (A short bounded spin still left decode far slower under load: docs/lab,
# "Reliability", a shared CPU.) The runtime reads this when it loads (with torch), so it is set before anything imports
# torch; a wait policy or spin count the user chose is left alone.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
