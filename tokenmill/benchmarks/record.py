"""What every benchmark record names: the machine and the versions it ran with."""

from __future__ import annotations

import os
import platform


def machine_info() -> dict:
    import torch
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_model": _cpu_model(), "cpu_flags": _cpu_flags(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


_INTERESTING_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma")


def _cpuinfo_field(name: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_model() -> str:
    return _cpuinfo_field("model name") or platform.processor()


def _cpu_flags() -> list[str]:
    flags = set(_cpuinfo_field("flags").split())
    return [f for f in _INTERESTING_FLAGS if f in flags]


def versions() -> dict:
    import torch
    import transformers

    import tokenmill
    found = {"tokenmill": tokenmill.__version__, "python": platform.python_version(),
             "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton
        found["triton"] = triton.__version__
    except ImportError:
        pass
    return found
