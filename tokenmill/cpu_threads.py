"""OpenMP defaults for CPU inference, set before torch loads its OpenMP runtime.

torch's CPU kernels run each op as an OpenMP parallel region. By default the
runtime's threads spin-wait between regions, which is fine on an idle machine
but collapses when other processes share the cores: a region then waits for a
descheduled thread a whole time slice, and small ops (decode-sized matmuls,
elementwise ops) take ~10 ms instead of ~0.1 ms. With the passive wait policy
idle threads sleep instead, which costs microseconds when the machine is idle
and saves 10x when it is not.

Only defaults: a value the user set wins. Effective only when tokenmill is
imported before torch (libgomp reads the environment once, when it loads).
"""

from __future__ import annotations

import os


def set_openmp_defaults() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
