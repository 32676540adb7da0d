"""Builds a small C source into a shared library once per machine, and loads it through ctypes.

The library lands in ~/.cache/tokenmill (or $XDG_CACHE_HOME/tokenmill) under a name keyed by the
source, compiler, flags and the CPU's feature flags (`-march=native` code must not move between
machines). Returns None, and logs why, where no C compiler is found, the build fails, or
TOKENMILL_NO_C_KERNELS=1 is set; callers then use their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

logger = logging.getLogger(__name__)

# Common flags. Never -ffast-math: a shared object built with it sets flush-to-zero for the
# whole process when loaded (gcc's crtfastmath), changing every other float computation in it.
BASE_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")


def disabled() -> bool:
    return os.environ.get("TOKENMILL_NO_C_KERNELS", "") in ("1", "true", "yes")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(name: str, source: str, flags: tuple[str, ...]) -> ctypes.CDLL | None:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    key = hashlib.sha1("\0".join([source, cc, *flags, _cpu_flags()]).encode()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tokenmill")
    path = os.path.join(cache, f"{name}_{key}.so")
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src = os.path.join(tmp, f"{name}.c")
            with open(src, "w") as f:
                f.write(source)
            out = os.path.join(tmp, f"{name}.so")
            subprocess.run([cc, *flags, src, "-o", out, "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(out, path)  # atomic: concurrent builders race harmlessly
    return ctypes.CDLL(path)


def load_library(name: str, source: str, flags: tuple[str, ...],
                 signatures: dict[str, list]) -> ctypes.CDLL | None:
    """The built library with `signatures` (function name -> ctypes argtypes, returning void)
    set; None where it cannot be had (the reason is logged)."""
    if disabled():
        return None
    try:
        lib = _build(name, source, flags)
        if lib is None:
            logger.warning("C kernel %s unavailable (no C compiler found), using torch", name)
            return None
        for fn_name, argtypes in signatures.items():
            fn = getattr(lib, fn_name)
            fn.restype = None
            fn.argtypes = argtypes
        return lib
    except Exception as exc:  # noqa: BLE001 - build error, unloadable library: use torch
        logger.warning("C kernel %s unavailable, using torch: %s", name, exc)
        return None
