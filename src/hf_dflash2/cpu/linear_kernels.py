"""A whole model's linear layers on one kernel: ``use_linear_kernel(model, "auto" | "onednn" | "default")``.

Generation calls do not need this: ``speculative_generate`` and ``generate(assistant_model=head)`` choose the
kernel per forward themselves, scoped to the call (``kernels_dflash2.ForwardKernels``). This is for code that
runs a model outside those calls (plain ``generate``, training, regeneration) and wants one kernel for it.

"auto" times both kernels over the model's own linear layers at 1 and 16 rows (cached per CPU model, torch
version, threads, dtype and layer shapes) and packs only where oneDNN is clearly faster over the two; the
packed forward is an instance attribute on each ``nn.Linear`` (``kernels_dflash2.PackedLinearForward``), so
parameters, ``state_dict`` and ``save_pretrained`` are untouched. The cost is one more copy of the linear
weights in memory.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..cost_model_dflash2 import linear_kernel_of
from ..kernels_dflash2 import (
    KERNEL_CHOICES,
    WHOLE_MODEL_ROWS,
    ForwardKernels,
    KernelSwitch,
    PackedLinearForward,
    onednn_available,
    onednn_linear,
    onednn_speedup,
    pack_linears,
    time_onednn_speedup,
    unpack_linears,
)

__all__ = ["LINEAR_KERNELS", "ForwardKernels", "KernelSwitch", "PackedLinearForward", "decode_probe_kernels",
           "linear_kernel_of", "onednn_linear", "onednn_speedup", "pack_linears", "time_onednn_speedup",
           "unpack_linears", "use_linear_kernel"]
logger = logging.getLogger(__name__)

LINEAR_KERNELS = KERNEL_CHOICES
# What `auto` demands of oneDNN over a plain step plus a 16-row verify: a clear win, not timer noise.
ONEDNN_MIN_SPEEDUP = 1.1
PROBE_ROWS = WHOLE_MODEL_ROWS


def decode_probe_kernels(linear_kernel: str) -> tuple[str, ...]:
    """The kernels the decode-precision probe may time each dtype on, for a ``--linear-kernel`` choice."""
    check_linear_kernel(linear_kernel)
    if linear_kernel == "auto":
        return ("default", "onednn") if onednn_available() else ("default",)
    return (linear_kernel,)


def check_linear_kernel(kernel: str) -> None:
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernel must be one of {LINEAR_KERNELS}, got {kernel!r}")


def use_linear_kernel(model: torch.nn.Module, kernel: str = "auto",
                      probe: Callable[[torch.nn.Module], float] | None = None,
                      rows: tuple[int, ...] = PROBE_ROWS) -> str:
    """Put ``model``'s CPU linear layers on ``kernel`` -> the kernel now in use ("onednn" or "default").

    "auto": oneDNN where ``probe(model)`` (default: ``onednn_speedup`` over the model's layers at each of
    ``rows`` rows, timed once per machine and cached; decoding's plain step and widest verify unless the
    caller's workload is another, e.g. regeneration's batch) is at least ``ONEDNN_MIN_SPEEDUP``; models off
    the CPU, or torch builds without oneDNN, stay on the default. "onednn" packs whatever the speed (a CPU
    model is required); "default" unpacks.
    """
    check_linear_kernel(kernel)
    parameter = next(model.parameters(), None)
    on_cpu = parameter is not None and parameter.device.type == "cpu"
    if kernel == "default":
        unpack_linears(model)
        return "default"
    if kernel == "onednn":
        if not on_cpu:
            raise ValueError(f"linear_kernel='onednn' needs a CPU model, got one on {parameter and parameter.device}")
        try:
            pack_linears(model)
        except RuntimeError as error:
            raise ValueError(f"linear_kernel='onednn': {error}") from None
        return "onednn"
    if not on_cpu or not onednn_available():
        return "default"
    unpack_linears(model)
    speedup = probe(model) if probe is not None else onednn_speedup(model, rows=tuple(rows))
    chosen = "onednn" if speedup >= ONEDNN_MIN_SPEEDUP else "default"
    if chosen == "onednn":
        pack_linears(model)
    logger.info("linear kernel auto (%s): oneDNN %.2fx the default over %s rows -> %s",
                type(model).__name__, speedup, "+".join(map(str, rows)), chosen)
    return chosen
