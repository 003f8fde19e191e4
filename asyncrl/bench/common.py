"""Shared output format of the benchmarks: machine description, JSON file, printed table."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


def write_result(scenario: str, result: dict[str, Any], output: str | os.PathLike[str] = "bench") -> Path:
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    result = {"scenario": scenario, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine_info(), **result}
    path = out / f"{scenario}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2, default=float))
    return path


def print_table(title: str, rows: list[tuple[str, Any]]) -> None:
    width = max((len(k) for k, _ in rows), default=10)
    print(f"\n== {title} ==")
    for key, value in rows:
        if isinstance(value, float):
            value = f"{value:,.4g}"
        print(f"  {key.ljust(width)}  {value}")
