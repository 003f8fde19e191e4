"""Shared parts of the benchmarks: list-valued flags, machine description, JSON file, printed table."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any


def int_list(text: str) -> list[int]:
    """A grid flag's value, comma-separated integers (`0,1,4`); argparse names the flag on error."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 0,1,4, got {text!r}")
    return values


def str_list(text: str) -> list[str]:
    """A comma-separated list of names (`none,tis`)."""
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return values


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
