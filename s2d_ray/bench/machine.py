"""What a benchmark ran on: recorded with every result so figures from different machines are never mixed up."""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys

from ..machines import cpu_isa, cpu_model


def machine_info() -> dict:
    import torch
    import transformers

    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_isa": cpu_isa(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "argv": sys.argv,
    }


def load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None
