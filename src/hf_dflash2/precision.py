"""Pick the compute precision the machine is fast at: ``--mixed-precision auto``.

The CPUs this project runs on differ from session to session: with AMX or AVX-512-BF16 a bf16 matmul is
2-5x faster than fp32, with AVX2 only it is ~300x *slower*. So ``auto`` never guesses from the torch
build: on CUDA it asks the device, on CPU it times one small product in both dtypes (well under a
second) and caches the verdict per CPU model and torch version, so later runs decide instantly.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from .cost_model_dflash2 import _device_name, cost_cache_dir

logger = logging.getLogger(__name__)

PRECISION_CHOICES = ("auto", "bf16", "fp32", "no", "fp16")
# What `auto` demands of bf16 before choosing it: a clear win, not a tie within timer noise.
BF16_MIN_SPEEDUP = 1.2


def _cache_path() -> Path:
    return cost_cache_dir() / "precision.json"


def _cpu_has_bf16_flags() -> bool | None:
    """True/False from /proc/cpuinfo flags; None where the file does not say (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    if flags is None:
        return None
    return "amx_bf16" in flags or "avx512_bf16" in flags


def time_matmul_speedup(size: int = 512, repeats: int = 5) -> float:
    """fp32 time / bf16 time of a ``size``-square matmul on the CPU (median of ``repeats``)."""
    timings = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(size, size * 3, dtype=dtype)
        b = torch.randn(size * 3, size, dtype=dtype)
        a @ b  # first call pays for kernel selection
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            samples.append(time.perf_counter() - start)
        timings[dtype] = sorted(samples)[len(samples) // 2]
    return timings[torch.float32] / max(timings[torch.bfloat16], 1e-9)


def cpu_bf16_is_fast(use_cache: bool = True) -> bool:
    """Whether bf16 matmuls beat fp32 clearly on this CPU (cached per CPU model and torch version)."""
    if _cpu_has_bf16_flags() is False:
        return False  # AVX2 only: bf16 is emulated; timing it would itself take seconds
    key = f"{_device_name(torch.device('cpu'))} | torch {torch.__version__} | threads {torch.get_num_threads()}"
    path = _cache_path()
    cache = {}
    if use_cache and path.exists():
        try:
            cache = json.loads(path.read_text())
            if not isinstance(cache, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as error:
            logger.warning("ignoring unreadable precision cache %s (%s)", path, error)
            cache = {}
        entry = cache.get(key)
        if isinstance(entry, dict) and isinstance(entry.get("speedup"), (int, float)):
            return entry["speedup"] >= BF16_MIN_SPEEDUP
    speedup = time_matmul_speedup()
    if use_cache:
        cache[key] = {"speedup": round(speedup, 3)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            os.replace(tmp, path)
        except OSError as error:
            logger.warning("could not cache the precision probe at %s (%s)", path, error)
    return speedup >= BF16_MIN_SPEEDUP


def bf16_is_fast(device: torch.device | str | None = None) -> bool:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_bf16_is_fast()
    return False


def resolve_precision(choice: str, device: torch.device | str | None = None, probe=None) -> str:
    """``auto`` -> ``"bf16"`` or ``"no"`` (accelerate's name for fp32); other names pass through.

    ``probe`` (a callable returning bool) replaces the speed test, for tests and for callers that know.
    """
    if choice not in PRECISION_CHOICES:
        raise ValueError(f"mixed precision must be one of {PRECISION_CHOICES}, got {choice!r}")
    if choice == "fp32":
        return "no"
    if choice != "auto":
        return choice
    fast = probe() if probe is not None else bf16_is_fast(device)
    chosen = "bf16" if fast else "no"
    logger.info("precision auto: bf16 matmul is %s here -> %s", "fast" if fast else "slow", "bf16" if fast else "fp32")
    return chosen


def resolve_dtype(choice: str, device: torch.device | str | None = None, probe=None) -> torch.dtype:
    """The torch dtype to load a model in for ``choice`` (``auto`` measures, see ``resolve_precision``)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}[
        resolve_precision(choice, device, probe)
    ]
