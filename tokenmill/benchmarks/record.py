"""What every benchmark record names: the machine and the versions it ran with."""

from __future__ import annotations

import os
import platform


def machine_info() -> dict:
    import torch
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def cpu_model() -> str:
    """The CPU's model name (as `lscpu` prints it), or '' where /proc/cpuinfo has none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def versions() -> dict:
    import torch
    import transformers

    import tokenmill
    return {"tokenmill": tokenmill.__version__, "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__}
