"""Which kernel multiplies a CPU model's linear layers: ``--linear-kernel auto``.

A speculative round verifies a few rows per weight matrix where a plain step multiplies one. On some CPUs
PyTorch's default fp32 path (MKL) is much slower at 2-16 rows than at one: on the AVX2-only AMD EPYC of
session 18 a 16-token verify of SmolLM2-135M cost 2.0-2.4 plain steps with it, and 1.4 with oneDNN and
weights packed once (``benchmarks/linear_kernels.py``). Below ~2 steps per verify a head at tau 2.5 pays;
above it, it barely does. The packed path was also faster at one row there, so plain greedy gains too.

``use_linear_kernel(model, "auto")`` times both kernels over the model's own linear layers at 1 and 16
rows (the plain step and the widest verify; about 4 s for SmolLM2-135M on 2 threads, cached per CPU
model, torch version, threads, dtype and layer shapes) and packs only where oneDNN is clearly faster.
The packed forward is a plain instance attribute on each ``nn.Linear``: parameters, ``state_dict`` and
``save_pretrained`` are untouched, and a layer falls back to ``F.linear`` whenever the packed copy could
be wrong or unusable: its weight was changed or moved since packing, gradients are wanted, or the input
is not a CPU tensor of the packed dtype. The cost is one more copy of the linear weights in memory.

Every method of a benchmark runs on the same kernels, so plain greedy is the same model on both sides
of a ratio; like any kernel choice, the packed path sums in another order, so its logits differ from the
default's in the last bits (greedy tokens can differ only at exact near-ties).
"""

from __future__ import annotations

import logging
import statistics
import time
import weakref
from collections import Counter
from typing import Callable

import torch
import torch.nn.functional as F

from .cost_model_dflash2 import cost_cache_dir, linear_kernel_of
from .precision import cached_speedup, cpu_key

__all__ = ["LINEAR_KERNELS", "KernelSwitch", "PackedLinearForward", "decode_probe_kernels", "linear_kernel_of",
           "onednn_linear", "onednn_speedup", "pack_linears", "unpack_linears", "use_linear_kernel"]
logger = logging.getLogger(__name__)

LINEAR_KERNELS = ("auto", "onednn", "default")
# What `auto` demands of oneDNN over a plain step plus a 16-row verify: a clear win, not timer noise.
ONEDNN_MIN_SPEEDUP = 1.1
PROBE_ROWS = (1, 16)
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(weight: torch.Tensor, rows_hint: int = PROBE_ROWS[-1]) -> Callable[..., torch.Tensor]:
    """``(x, bias=None) -> F.linear(x, weight, bias)`` through oneDNN with ``weight`` packed once;
    RuntimeError where this CPU cannot pack its dtype (bf16 needs AVX-512 or AVX-NE-CONVERT)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
    return lambda x, bias=None: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def decode_probe_kernels(linear_kernel: str) -> tuple[str, ...]:
    """The kernels the decode-precision probe may time each dtype on, for a ``--linear-kernel`` choice."""
    check_linear_kernel(linear_kernel)
    if linear_kernel == "auto":
        return ("default", "onednn") if _onednn_available() else ("default",)
    return (linear_kernel,)


def _version(weight: torch.Tensor) -> int | None:
    """In-place writes bump a tensor's version; inference tensors (made under ``inference_mode``) keep none."""
    return None if weight.is_inference() else weight._version


class PackedLinearForward:
    """The forward of one ``nn.Linear`` through oneDNN with its weight packed once, or ``F.linear``
    whenever the packed copy is stale (weight written in place, replaced or moved), gradients are wanted,
    or the input is not a CPU tensor of the packed dtype."""

    kernel = "onednn"  # what ``linear_kernel_of`` reports, part of the cost model's key

    def __init__(self, module: torch.nn.Linear, rows_hint: int = PROBE_ROWS[-1]):
        weight = module.weight
        self.module = weakref.ref(module)
        self.packed_linear = onednn_linear(weight, rows_hint)
        self.dtype, self.data_ptr, self.version = weight.dtype, weight.data_ptr(), _version(weight)

    def __deepcopy__(self, memo: dict) -> "PackedLinearForward":
        # A deep-copied model's layer must read its own weight: point at the copy (already in ``memo`` when
        # the copy is made through its module). The copy's weight lives elsewhere, so it runs ``F.linear``.
        copied = object.__new__(PackedLinearForward)
        copied.__dict__.update(self.__dict__)
        module = self.module()
        if module is not None and id(module) in memo:
            copied.module = weakref.ref(memo[id(module)])
        return copied

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module()
        weight, bias = module.weight, module.bias
        if (weight.data_ptr() != self.data_ptr or _version(weight) != self.version or x.dtype != self.dtype
                or x.device.type != "cpu" or weight.device.type != "cpu"
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))):
            return F.linear(x, weight, bias)
        return self.packed_linear(x, bias)


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def pack_linears(model: torch.nn.Module) -> int:
    """Route every CPU fp32 / bf16 ``nn.Linear`` of ``model`` through oneDNN (packed weights); -> how many."""
    if not _onednn_available():
        raise RuntimeError("this torch build has no oneDNN linear kernel (torch.backends.mkldnn is unavailable)")
    packed = 0
    for module in _linears(model):
        current = module.__dict__.get("forward")
        if current is not None and not isinstance(current, PackedLinearForward):
            continue  # someone else's forward (e.g. accelerate's offload hooks): leave it alone
        if module.weight.device.type == "cpu" and module.weight.dtype in _PACKABLE_DTYPES:
            try:
                module.forward = PackedLinearForward(module)
            except RuntimeError as error:  # e.g. bf16 packing needs AVX-512 or AVX-NE-CONVERT
                unpack_linears(model)
                raise RuntimeError(f"oneDNN cannot pack {module.weight.dtype} linear weights on this CPU: {error}")
            packed += 1
    return packed


def unpack_linears(model: torch.nn.Module) -> None:
    """Back to PyTorch's default linear kernel (drops the packed copies)."""
    for module in _linears(model):
        if isinstance(module.__dict__.get("forward"), PackedLinearForward):
            del module.forward


class KernelSwitch:
    """Both kernels for some models: packed once, then switched by swapping the linear layers' forwards,
    so switching costs nothing (the probe, and benchmarks that time both kernels side by side)."""

    kernels = ("default", "onednn")

    def __init__(self, *models: torch.nn.Module):
        self.layers = []
        for model in models:
            pack_linears(model)
            self.layers += [(m, m.__dict__["forward"]) for m in _linears(model)
                            if isinstance(m.__dict__.get("forward"), PackedLinearForward)]
            unpack_linears(model)

    def use(self, kernel: str) -> None:
        for module, forward in self.layers:
            if kernel == "onednn":
                module.forward = forward
            else:
                module.__dict__.pop("forward", None)


def _median_pass_seconds(linears: list[torch.nn.Linear], rows: int, repeats: int) -> float:
    """Median seconds of one pass over ``linears`` in model order (weights read cold, as in a forward)."""
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=m.weight.dtype) for m in linears}
    samples = []
    with torch.no_grad():
        for repeat in range(repeats + 1):  # the first pass picks kernels and is not counted
            start = time.perf_counter()
            for module in linears:
                module(inputs[module.in_features])
            if repeat:
                samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_onednn_speedup(model: torch.nn.Module, rows: tuple[int, ...] = PROBE_ROWS, repeats: int = 3) -> float:
    """Default-kernel seconds / oneDNN seconds of a pass over the model's CPU linear layers at each number
    of ``rows``, summed over ``rows`` (a plain step plus a verify); the kernels interleaved per repeat.
    Leaves the model on the default kernel."""
    linears = [m for m in _linears(model) if m.weight.device.type == "cpu" and m.weight.dtype in _PACKABLE_DTYPES]
    if not linears:
        return 1.0
    try:
        switch = KernelSwitch(model)
    except RuntimeError as error:
        logger.info("linear kernel probe: %s", error)
        return 0.0  # cannot pack here: never chosen
    totals = {kernel: [] for kernel in switch.kernels}
    for _ in range(repeats):
        for kernel in switch.kernels:
            switch.use(kernel)
            totals[kernel].append(sum(_median_pass_seconds(linears, n, 1) for n in rows))
    switch.use("default")
    return statistics.median(totals["default"]) / max(statistics.median(totals["onednn"]), 1e-9)


def _probe_key(model: torch.nn.Module, rows: tuple[int, ...] = PROBE_ROWS) -> str:
    shapes = Counter((m.in_features, m.out_features) for m in _linears(model))
    key = f"{cpu_key()} | {next(model.parameters()).dtype} | {sorted(shapes.items())}"
    return key if tuple(rows) == PROBE_ROWS else f"{key} | rows {list(rows)}"  # decode keys predate rows


def onednn_speedup(model: torch.nn.Module, use_cache: bool = True, rows: tuple[int, ...] = PROBE_ROWS) -> float:
    """``time_onednn_speedup(model, rows)``, cached in ``linear_kernel.json`` beside the cost models (an
    unreadable cache is ignored with a warning and measured again)."""
    return cached_speedup(cost_cache_dir() / "linear_kernel.json", _probe_key(model, rows),
                          lambda: time_onednn_speedup(model, rows), "linear-kernel", use_cache)


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
    if not on_cpu or not _onednn_available():
        return "default"
    unpack_linears(model)
    speedup = probe(model) if probe is not None else onednn_speedup(model, rows=tuple(rows))
    chosen = "onednn" if speedup >= ONEDNN_MIN_SPEEDUP else "default"
    if chosen == "onednn":
        pack_linears(model)
    logger.info("linear kernel auto (%s): oneDNN %.2fx the default over %s rows -> %s",
                type(model).__name__, speedup, "+".join(map(str, rows)), chosen)
    return chosen
