"""Helpers shared by the benchmark scripts: interleaved timing, medians, JSON + table output."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def interleaved(candidates: dict, repeats: int, warmup: int = 1) -> dict:
    """Median seconds of each callable, timed round-robin so drift hits all of them alike."""
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(ts) for name, ts in times.items()}


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=1) + "\n")
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for c in columns:
            v = row.get(c, "")
            cells.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
