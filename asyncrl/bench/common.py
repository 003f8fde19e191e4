"""Shared parts of the benchmarks: list-valued flags, machine description, JSON file, printed table."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
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
        if info["cuda"]:
            info["cuda_devices"] = torch.cuda.device_count()
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


def machine_tag(machine: dict[str, Any]) -> str:
    """A result file's machine name: `cpu<cores>` without a GPU (`cpu2`), else the GPU's model and count
    (`h100x8`)."""
    gpu = machine.get("cuda")
    if not gpu:
        return f"cpu{machine.get('cpu_count') or 0}"
    model = re.search(r"\b([A-Z]+\d+[A-Z]*)\b", gpu)
    name = model.group(1).lower() if model else re.sub(r"[^a-z0-9]+", "", gpu.lower())
    return f"{name}x{machine.get('cuda_devices', 1)}"


def record_result(written: Path, record_dir: str | os.PathLike[str]) -> Path:
    """Copy a written result to `record_dir/<scenario>-<machine>.json` (docs/results/ by default), replacing
    the previous run's: the documentation keeps one current file per scenario and machine, and git keeps
    the history. A plot the result names (`plot`) comes along as `<scenario>-<machine>.png`."""
    result = json.loads(Path(written).read_text())
    out = Path(record_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{result['scenario']}-{machine_tag(result['machine'])}"
    plot = result.get("plot")
    if plot and Path(plot).is_file():
        shutil.copyfile(plot, out / f"{stem}.png")
        result["plot"] = f"{stem}.png"
    path = out / f"{stem}.json"
    path.write_text(json.dumps(result, indent=2, default=float))
    return path


def print_table(title: str, rows: list[tuple[str, Any]]) -> None:
    width = max((len(k) for k, _ in rows), default=10)
    print(f"\n== {title} ==")
    for key, value in rows:
        if isinstance(value, float):
            value = f"{value:,.4g}"
        print(f"  {key.ljust(width)}  {value}")


def save_figure(fig: Any, out: Path, scenario: str) -> Path:
    """A scenario's matplotlib figure as `<out>/<scenario>-<time>.png` (the figure is closed)."""
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{scenario}-{time.strftime('%Y%m%d-%H%M%S')}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
