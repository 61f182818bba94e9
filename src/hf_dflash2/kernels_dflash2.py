"""The linear kernel of each forward, chosen by its width: PyTorch's default or oneDNN with packed weights.

On a CPU the faster kernel for a weight matrix depends on how many rows multiply it, and the ranking changes
from one CPU to the next (AMX, AVX-512-BF16, AVX-512 without bf16, AVX2): oneDNN can win at a 16-row verify
and lose at the 1-row plain step. So nothing is hard-coded. ``ForwardKernels`` measures, once per machine
and layer shapes (cached beside the cost models), oneDNN's speedup over the default for the target at a
plain step, a short verify and a block, and for the drafter's pass at its block; then, for the duration of
one generation call, a forward pre-hook puts each forward's linear layers on the faster kernel for the rows
it multiplies. On exit every layer's forward is exactly what it was before the call, so the caller's model
is unchanged (including a kernel the caller chose with ``hf_dflash2.use_linear_kernel``).

The packed forward is a plain instance attribute on each ``nn.Linear``: parameters, ``state_dict`` and
``save_pretrained`` are untouched, and a layer falls back to ``F.linear`` whenever the packed copy could be
wrong or unusable (its weight changed or moved since packing, gradients are wanted, or the input is not a
CPU tensor of the packed dtype). Both kernels compute the same products; they sum in another order, so
logits differ in the last bits (greedy tokens can differ only at exact near-ties).

Shipped with saved heads as remote code (sibling of ``candidate_generator_dflash2.py``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
import weakref
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .cost_model_dflash2 import _device_name, cost_cache_dir

logger = logging.getLogger(__name__)

KERNEL_CHOICES = ("auto", "default", "onednn")
# Rows per batch row at which the target's kernels are compared: a plain step, a short verify, a block.
PROBE_WIDTHS = (1, 4, 16)
# A whole model on one kernel (``use_linear_kernel``) is probed at a plain step plus a 16-row verify; the
# cache's keys for that probe carry no row count, so that caches written before per-width probes still load.
WHOLE_MODEL_ROWS = (1, 16)
# oneDNN is chosen for a width only when it is at least this much faster there: a win, not timer noise.
PER_FORWARD_MIN_SPEEDUP = 1.05
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
_UNSET = object()


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(weight: torch.Tensor, rows_hint: int = 16) -> Callable[..., torch.Tensor]:
    """``(x, bias=None) -> F.linear(x, weight, bias)`` through oneDNN with ``weight`` packed once;
    RuntimeError where this CPU cannot pack its dtype (bf16 needs AVX-512 or AVX-NE-CONVERT)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
    return lambda x, bias=None: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _version(weight: torch.Tensor) -> int | None:
    """In-place writes bump a tensor's version; inference tensors (made under ``inference_mode``) keep none."""
    return None if weight.is_inference() else weight._version


class PackedLinearForward:
    """The forward of one ``nn.Linear`` through oneDNN with its weight packed once, or ``F.linear``
    whenever the packed copy is stale (weight written in place, replaced or moved), gradients are wanted,
    or the input is not a CPU tensor of the packed dtype."""

    kernel = "onednn"  # what ``linear_kernel_of`` reports, part of the cost model's key

    def __init__(self, module: torch.nn.Linear, rows_hint: int = 16):
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

    def is_stale(self) -> bool:
        module = self.module()
        return (module is None or module.weight.data_ptr() != self.data_ptr
                or _version(module.weight) != self.version or module.weight.device.type != "cpu")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Runs for every linear layer of every forward: each check is the cheapest form of itself (the
        # parameter dict rather than ``nn.Module.__getattr__``, ``is_cpu`` rather than a device object).
        module = self.module()
        params = module._parameters
        weight = params.get("weight")
        if weight is None:  # a parametrized or otherwise computed weight: the module says what it is
            weight = module.weight
        bias = params["bias"] if "bias" in params else module.bias
        if (weight.data_ptr() != self.data_ptr or x.dtype != self.dtype or not x.is_cpu or not weight.is_cpu
                or (None if weight.is_inference() else weight._version) != self.version
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))):
            return F.linear(x, weight, bias)
        return self.packed_linear(x, bias)


def linear_layers(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's linear layers whose forward is ``nn.Linear``'s own: a subclass with a forward of its own
    (a quantised or adapter layer) computes something else, and is never routed through oneDNN."""
    return [m for m in model.modules()
            if isinstance(m, torch.nn.Linear) and type(m).forward is torch.nn.Linear.forward]


def pack_linears(model: torch.nn.Module) -> int:
    """Route every CPU fp32 / bf16 ``nn.Linear`` of ``model`` through oneDNN (packed weights); -> how many."""
    if not onednn_available():
        raise RuntimeError("this torch build has no oneDNN linear kernel (torch.backends.mkldnn is unavailable)")
    packed = 0
    for module in linear_layers(model):
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
    for module in linear_layers(model):
        if isinstance(module.__dict__.get("forward"), PackedLinearForward):
            del module.forward


class KernelSwitch:
    """Both kernels for some models: packed once, then switched by swapping the linear layers' forwards,
    so that switching costs nothing. Building one leaves every packable layer on the default kernel."""

    kernels = ("default", "onednn")

    def __init__(self, *models: torch.nn.Module):
        self.layers = []
        for model in models:
            pack_linears(model)
            self.layers += [(m, m.__dict__["forward"]) for m in linear_layers(model)
                            if isinstance(m.__dict__.get("forward"), PackedLinearForward)]
            unpack_linears(model)

    def use(self, kernel: str, only: torch.nn.Module | None = None) -> None:
        """Put the layers (or the one layer ``only``) on ``kernel``."""
        for module, forward in self.layers:
            if only is not None and module is not only:
                continue
            if kernel == "onednn":
                module.forward = forward
            else:
                module.__dict__.pop("forward", None)

    def is_stale(self) -> bool:
        return any(forward.is_stale() for _, forward in self.layers)


_SWITCHES: "weakref.WeakKeyDictionary[torch.nn.Module, KernelSwitch | None]" = weakref.WeakKeyDictionary()


def shared_switch(model: torch.nn.Module) -> KernelSwitch | None:
    """The model's ``KernelSwitch``, packed once and kept while its weights stay as packed (None where this
    CPU cannot pack them). The layers' forwards are left as they were."""
    switch = _SWITCHES.get(model, _UNSET)
    if switch is _UNSET or (switch is not None and switch.is_stale()):
        saved = [(m, m.__dict__.get("forward", _UNSET)) for m in linear_layers(model)]
        try:
            switch = KernelSwitch(model)
        except RuntimeError as error:
            logger.info("oneDNN cannot pack %s here: %s", type(model).__name__, error)
            switch = None
        finally:
            restore_forwards(saved)
        _SWITCHES[model] = switch
    return switch


def restore_forwards(saved: list[tuple[torch.nn.Module, object]]) -> None:
    """Put back the ``(layer, its instance forward or _UNSET)`` pairs recorded before a switch."""
    for module, forward in saved:
        if forward is _UNSET:
            module.__dict__.pop("forward", None)
        else:
            module.forward = forward


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


def time_onednn_speedup(model: torch.nn.Module, rows: tuple[int, ...] = WHOLE_MODEL_ROWS, repeats: int = 3) -> float:
    """Default-kernel seconds / oneDNN seconds of a pass over the model's CPU linear layers at each number
    of ``rows``, summed over ``rows``; the kernels interleaved per repeat. Leaves the layers unpacked."""
    linears = [m for m in linear_layers(model) if m.weight.device.type == "cpu" and m.weight.dtype in _PACKABLE_DTYPES]
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


def cpu_key() -> str:
    """What a CPU probe's verdict depends on beyond its workload: the CPU model, torch and the threads."""
    return f"{_device_name(torch.device('cpu'))} | torch {torch.__version__} | threads {torch.get_num_threads()}"


def cached_speedups(path: Path, key: str, measure: Callable[[], list[float]], what: str,
                    use_cache: bool = True) -> list[float]:
    """The figures stored under ``key`` in the JSON file ``path``, else ``measure()``, stored there (written
    whole to a temporary file, then renamed). A file that cannot be read or parsed is ignored with a
    warning naming ``what``, measured again and rewritten; an entry that is not a list of non-negative
    numbers is measured again."""
    cache: dict = {}
    if use_cache and path.exists():
        try:
            cache = json.loads(path.read_text())
            if not isinstance(cache, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as error:
            logger.warning("ignoring unreadable %s cache %s (%s)", what, path, error)
            cache = {}
        entry = cache.get(key)
        figures = entry.get("speedups", [entry.get("speedup")]) if isinstance(entry, dict) else None
        if (isinstance(figures, list) and figures
                and all(isinstance(f, (int, float)) and not isinstance(f, bool) and f >= 0 for f in figures)):
            return [float(f) for f in figures]
    figures = [float(f) for f in measure()]
    if use_cache:
        cache[key] = {"speedup": round(figures[0], 3)} if len(figures) == 1 else {
            "speedups": [round(f, 3) for f in figures]}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(cache, indent=1))
            os.replace(tmp, path)
        except OSError as error:
            logger.warning("could not cache the %s probe at %s (%s)", what, path, error)
    return figures


def cached_speedup(path: Path, key: str, measure: Callable[[], float], what: str, use_cache: bool = True) -> float:
    """``cached_speedups`` for one figure."""
    return cached_speedups(path, key, lambda: [measure()], what, use_cache)[0]


def probe_key(model: torch.nn.Module, rows: tuple[int, ...]) -> str:
    shapes = Counter((m.in_features, m.out_features) for m in linear_layers(model))
    key = f"{cpu_key()} | {next(model.parameters()).dtype} | {sorted(shapes.items())}"
    return key if tuple(rows) == WHOLE_MODEL_ROWS else f"{key} | rows {list(rows)}"


def onednn_speedup(model: torch.nn.Module, use_cache: bool = True,
                   rows: tuple[int, ...] = WHOLE_MODEL_ROWS) -> float:
    """``time_onednn_speedup(model, rows)``, cached in ``linear_kernel.json`` beside the cost models."""
    return cached_speedup(cost_cache_dir() / "linear_kernel.json", probe_key(model, rows),
                          lambda: time_onednn_speedup(model, rows), "linear-kernel", use_cache)


class _DraftPass(torch.nn.Module):
    """The layers one draft pass multiplies: the drafter's and the target's LM head (probed together)."""

    def __init__(self, drafter: torch.nn.Module, lm_head: torch.nn.Module | None):
        super().__init__()
        self.drafter, self.lm_head = drafter, lm_head


class ForwardKernels:
    """Within a ``with`` block, each forward of ``target`` runs its linear layers on the kernel measured
    fastest for the rows it multiplies, and each draft pass of ``drafter`` (with the target's LM head) on the
    kernel fastest at its block. On exit the layers' forwards are restored exactly.

    Args:
        target: the target model (a no-op unless its weights are fp32 / bf16 on a CPU with oneDNN).
        drafter: the head, or None.
        batch_size: rows of the batch (a forward over ``w`` tokens multiplies ``batch_size * w`` rows).
        block_size: the drafter's block (its pass multiplies ``batch_size * block_size`` rows).
        kernel: "auto" (per forward, measured), "default" or "onednn" (every forward), None (leave as loaded).
        speedup: ``(module, rows) -> oneDNN's speedup over the default`` for a pass over ``module``'s linear
            layers at ``rows`` rows; default ``onednn_speedup`` (measured once per machine, cached). Tests
            inject timings here.
    """

    def __init__(self, target, drafter=None, batch_size: int = 1, block_size: int = 16, kernel: str | None = "auto",
                 speedup: Callable[[torch.nn.Module, int], float] | None = None):
        if kernel is not None and kernel not in KERNEL_CHOICES:
            raise ValueError(f"linear_kernel must be one of {KERNEL_CHOICES} or None, got {kernel!r}")
        self.target, self.drafter, self.kernel = target, drafter, kernel
        self.batch_size, self.block_size = max(1, batch_size), max(1, block_size)
        self.speedup = speedup or (lambda module, rows: onednn_speedup(module, rows=(rows,)))
        self.target_kernels: dict[int, str] = {}  # width -> kernel
        self.draft_kernel: str | None = None
        self._saved, self._hooks = [], []
        self._current: str | None = None
        self.active = False

    def applies(self) -> bool:
        parameter = next(self.target.parameters(), None)
        return (self.kernel is not None and parameter is not None and parameter.device.type == "cpu"
                and parameter.dtype in _PACKABLE_DTYPES and onednn_available()
                and "_dflash2_forward_kernels" not in self.target.__dict__)  # an enclosing call decides

    def _choose(self, module: torch.nn.Module, rows: int) -> str:
        if self.kernel != "auto":
            return self.kernel
        return "onednn" if self.speedup(module, rows) >= PER_FORWARD_MIN_SPEEDUP else "default"

    def describe(self) -> str:
        """The choices, e.g. ``per-forward 1:default 4:onednn 16:onednn draft:onednn`` (part of cost keys)."""
        widths = " ".join(f"{w}:{k}" for w, k in self.target_kernels.items())
        return f"per-forward {widths} draft:{self.draft_kernel}"

    def kernel_for_rows(self, rows: int) -> str:
        """The target's kernel for a forward over ``rows`` rows: the decision at the nearest probed width."""
        width = rows / self.batch_size
        nearest = min(self.target_kernels, key=lambda w: abs(math.log(max(width, 1)) - math.log(w)))
        return self.target_kernels[nearest]

    def __enter__(self) -> "ForwardKernels":
        if not self.applies():
            return self
        models = [self.target] + ([self.drafter] if self.drafter is not None else [])
        self._saved = [(m, m.__dict__.get("forward", _UNSET)) for model in models for m in linear_layers(model)]
        try:
            self.target_switch = shared_switch(self.target)
            self.drafter_switch = shared_switch(self.drafter) if self.drafter is not None else None
            if self.target_switch is None:
                self._restore()
                return self
            for width in PROBE_WIDTHS:
                self.target_kernels[width] = self._choose(self.target, self.batch_size * width)
            self.lm_head = getattr(self.target, "get_output_embeddings", lambda: None)()
            if self.drafter is not None:
                lm_head = self.lm_head if isinstance(self.lm_head, torch.nn.Linear) else None
                self.draft_kernel = self._choose(_DraftPass(self.drafter, lm_head), self.batch_size * self.block_size)
        except BaseException:
            self._restore()
            raise
        # what ``linear_kernel_of`` reports for both models (cost-model keys) whatever layer is switched when
        self.target.__dict__["_dflash2_forward_kernels"] = self.describe()
        if self.drafter is not None:
            self.drafter.__dict__["_dflash2_forward_kernels"] = self.describe()
        self._hooks.append(self.target.register_forward_pre_hook(self._before_target, with_kwargs=True))
        if self.drafter is not None:
            self._hooks.append(self.drafter.register_forward_pre_hook(self._before_draft))
        self.active = True
        if self.kernel == "auto":
            logger.info("linear kernels: %s", self.describe())
        return self

    def _before_target(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        rows = ids.shape[0] * ids.shape[1] if ids is not None and ids.dim() >= 2 else self.batch_size
        kernel = self.kernel_for_rows(rows)
        if kernel != self._current:
            self.target_switch.use(kernel)
            self._current = kernel
        return None

    def _before_draft(self, module, args):
        if self.drafter_switch is not None:
            self.drafter_switch.use(self.draft_kernel)
        if self.lm_head is not None and self.draft_kernel != self._current:
            self.target_switch.use(self.draft_kernel, only=self.lm_head)
            self._current = None  # the target's layers are mixed now: the next target forward sets them all
        return None

    def _restore(self) -> None:
        restore_forwards(self._saved)
        self._saved = []

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.active:
            self.target.__dict__.pop("_dflash2_forward_kernels", None)
            if self.drafter is not None:
                self.drafter.__dict__.pop("_dflash2_forward_kernels", None)
        self._restore()
        self.active = False
