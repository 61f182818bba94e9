"""Pick the compute precision the machine is fast at: ``--mixed-precision auto``.

The CPUs this project runs on differ from machine to machine: with AMX or AVX-512-BF16 a bf16 matmul is several
times faster than fp32, with AVX2 only it is emulated and orders of magnitude *slower*. So ``auto`` never guesses
from the torch build: on CUDA it asks the device, on CPU it times one small product in both dtypes (well under a
second) and caches the verdict per CPU model and torch version, so later runs decide instantly.

Two workloads, two probes. Training, feature stores and regeneration multiply hundreds of rows at once
(``workload="train"``: a square product). Decoding at batch 1 multiplies one row by each weight matrix
(and a verify a few rows): that is bound by reading the weights, and on some CPUs with fast bf16 *compute*
the one-row bf16 product is slower than fp32 (an Intel Xeon with AMX, ``benchmarks/cost/decode_dtype.py``).
So ``workload="decode"`` (demo, bench) times one decoder step's weight matrices at 1 and 16 rows (the plain
step and the widest verify) and picks bf16 only when it is clearly faster at the verify (``BF16_MIN_SPEEDUP``)
and not slower at the plain step, so neither side of a speculative-vs-greedy ratio is the one left slow.

Each dtype is timed on the linear kernels the caller allows (``linear_kernels``: PyTorch's default, and
oneDNN with packed weights), each dtype on its faster one. An Intel Xeon with AMX is why: there
a bf16 step on the default kernel is slower than fp32, while bf16 through oneDNN is the fastest plain step
of the four and has the cheapest 16-token verify relative to it (``benchmarks/cost/linear_kernel_sweep.py``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..cost_model_dflash2 import cost_cache_dir
from ..kernels_dflash2 import cached_speedup, cached_speedups, cpu_key  # noqa: F401  (re-exported)
from . import linear_kernels
from .linear_kernels import ONEDNN_MIN_SPEEDUP, check_linear_kernel, decode_probe_kernels

logger = logging.getLogger(__name__)

PRECISION_CHOICES = ("auto", "bf16", "fp32", "no", "fp16")
# What `auto` demands of bf16 before choosing it: a clear win, not a tie within timer noise.
BF16_MIN_SPEEDUP = 1.2
WORKLOADS = ("train", "decode")


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


DECODE_ROWS = (1, 16)  # the plain step, and the widest verify (a block of 16, or a draft tree of 16 slots)
# What `auto` demands of bf16 at the plain step: not slower (its verify must clear BF16_MIN_SPEEDUP).
BF16_MIN_STEP_SPEEDUP = 1.0
# SmolLM2-135M-Instruct, the product's reference target: used when the caller has no config at hand.
DEFAULT_DECODER = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "vocab_size": 49152}


def decoder_matrices(config=None) -> dict[tuple[int, int], int]:
    """{(in, out): count} of the weight matrices one decoder step reads: per layer the MLP's gate, up and
    down projections and the attention's query and output projections (keys and values are smaller under
    grouped-query attention and left out), then the LM head once."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dims = {name: getattr(text, name, None) or DEFAULT_DECODER[name] for name in DEFAULT_DECODER}
    hidden, inner, layers = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"]
    matrices: dict[tuple[int, int], int] = {}
    for shape, count in (((hidden, inner), 2 * layers), ((inner, hidden), layers), ((hidden, hidden), 2 * layers),
                         ((hidden, dims["vocab_size"]), 1)):
        matrices[shape] = matrices.get(shape, 0) + count
    return matrices


def time_decode_speedups(config=None, rows: tuple[int, ...] = DECODE_ROWS, repeats: int = 5,
                         kernels: tuple[str, ...] = ("default",)) -> list[float]:
    """fp32 time / bf16 time of one decoder step's weight reads (``decoder_matrices(config)``, each matrix
    weighted by its count) at each number of ``rows``: medians of ``repeats``, every (dtype, kernel) pair
    interleaved so drift hits all alike. Each dtype runs on its faster kernel among ``kernels`` ("default":
    ``F.linear``; "onednn": packed weights, taken when ``ONEDNN_MIN_SPEEDUP`` faster over all ``rows``, as
    ``use_linear_kernel`` decides); a dtype no allowed kernel can run counts as infinitely slow."""
    onednn_linear = linear_kernels.onednn_linear  # looked up at each call, as tests replace it

    dtypes = (torch.float32, torch.bfloat16)
    pairs = [(dtype, kernel) for dtype in dtypes for kernel in kernels]
    for dtype in dtypes:
        if "onednn" in kernels:
            try:
                onednn_linear(torch.zeros(8, 8, dtype=dtype))
            except RuntimeError as error:  # e.g. bf16 packing on a CPU without AVX-512
                logger.info("decode probe: oneDNN cannot pack %s here (%s)", dtype, error)
                pairs.remove((dtype, "onednn"))
    totals: dict[tuple, float] = {}
    for (fan_in, fan_out), count in decoder_matrices(config).items():
        functions = {}
        for dtype in dtypes:
            weight = torch.randn(fan_out, fan_in).to(dtype)  # once per shape
            for kernel in kernels:
                if (dtype, kernel) in pairs:
                    functions[dtype, kernel] = (onednn_linear(weight) if kernel == "onednn"
                                                else lambda x, w=weight: torch.nn.functional.linear(x, w))
        for n in rows:
            inputs = {dtype: torch.randn(n, fan_in).to(dtype) for dtype in dtypes}
            samples = {pair: [] for pair in functions}
            for repeat in range(repeats + 1):  # the first pass picks kernels and is not counted
                for (dtype, kernel), function in functions.items():
                    start = time.perf_counter()
                    function(inputs[dtype])
                    if repeat:
                        samples[dtype, kernel].append(time.perf_counter() - start)
            for pair, times in samples.items():
                totals[(n, *pair)] = totals.get((n, *pair), 0.0) + count * sorted(times)[repeats // 2]

    def fastest(dtype: torch.dtype) -> list[float] | None:
        timed = {kernel: [totals[n, dtype, kernel] for n in rows] for kernel in kernels
                 if all((n, dtype, kernel) in totals for n in rows)}
        if not timed:
            return None
        if "onednn" in timed and ("default" not in timed
                                  or sum(timed["default"]) >= ONEDNN_MIN_SPEEDUP * sum(timed["onednn"])):
            return timed["onednn"]
        return timed["default"]

    fp32, bf16 = fastest(torch.float32), fastest(torch.bfloat16)
    if fp32 is None or bf16 is None:
        return [0.0 if bf16 is None else float("inf")] * len(rows)
    return [a / max(b, 1e-12) for a, b in zip(fp32, bf16)]


def decode_bf16_is_faster(speedups: list[float]) -> bool:
    """The decode rule over ``time_decode_speedups``' (one row, verify rows) figures."""
    return speedups[0] >= BF16_MIN_STEP_SPEEDUP and min(speedups[1:], default=0.0) >= BF16_MIN_SPEEDUP


def cpu_bf16_is_fast(use_cache: bool = True, workload: str = "train", config=None,
                     kernels: tuple[str, ...] = ("default",)) -> bool:
    """Whether bf16 beats fp32 clearly on this CPU for ``workload`` ("train" or "decode", the latter for
    the decoder ``config`` describes, each dtype on its faster linear kernel among ``kernels``), cached per
    CPU model, torch version, thread count, workload, decoder shape and kernels."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    if _cpu_has_bf16_flags() is False:
        return False  # AVX2 only: bf16 is emulated; timing it would itself take seconds
    key = cpu_key()
    if workload == "train":  # the training key names no workload, so cached verdicts stay valid
        return cached_speedup(_cache_path(), key, time_matmul_speedup, "precision", use_cache) >= BF16_MIN_SPEEDUP
    key += f" | {workload} {sorted(decoder_matrices(config).items())} | rows {list(DECODE_ROWS)} | {sorted(kernels)}"
    speedups = cached_speedups(_cache_path(), key, lambda: time_decode_speedups(config, kernels=kernels),
                               "precision", use_cache)
    fast = decode_bf16_is_faster(speedups)
    logger.info("decode probe (kernels %s): bf16 %s fp32's speed at rows %s", "/".join(kernels),
                " / ".join(f"{x:.2f}x" for x in speedups), list(DECODE_ROWS))
    return fast


def bf16_is_fast(device: torch.device | str | None = None, workload: str = "train", config=None,
                 kernels: tuple[str, ...] = ("default",)) -> bool:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_bf16_is_fast(workload=workload, config=config, kernels=kernels)
    return False


def resolve_precision(choice: str, device: torch.device | str | None = None, probe=None,
                      workload: str = "train", config=None, kernels: tuple[str, ...] = ("default",)) -> str:
    """``auto`` -> ``"bf16"`` or ``"no"`` (accelerate's name for fp32); other names pass through.

    ``workload``: "train" (stores, regeneration, training) or "decode" (batch-1 generation: demo, bench),
    the latter probed with the shapes of the decoder ``config`` describes (SmolLM2-135M's when None), each
    dtype on its faster CPU linear kernel among ``kernels``.
    ``probe`` (a callable returning bool) replaces the speed test, for tests and for callers that know.
    """
    if choice not in PRECISION_CHOICES:
        raise ValueError(f"mixed precision must be one of {PRECISION_CHOICES}, got {choice!r}")
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    if choice == "fp32":
        return "no"
    if choice != "auto":
        return choice
    fast = probe() if probe is not None else bf16_is_fast(device, workload, config, kernels)
    chosen = "bf16" if fast else "no"
    logger.info("precision auto (%s): bf16 is %s here -> %s", workload, "fast" if fast else "slow",
                "bf16" if fast else "fp32")
    return chosen


def resolve_dtype(choice: str, device: torch.device | str | None = None, probe=None,
                  workload: str = "train", config=None, kernels: tuple[str, ...] = ("default",)) -> torch.dtype:
    """The torch dtype to load a model in for ``choice`` (``auto`` measures, see ``resolve_precision``)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}[
        resolve_precision(choice, device, probe, workload, config, kernels)
    ]


def load_target_for_decoding(choice: str, name_or_path=None, gguf_file=None, linear_kernel: str = "auto"):
    """Demo and bench: the target (and tokenizer) in the dtype ``choice`` resolves to for batch-1 decoding,
    its linear layers on PyTorch's default kernel, as a user loads it (the generation calls choose kernels per
    forward themselves, and the bench times plain greedy on each). ``auto`` loads in fp32, probes with the
    loaded model's own shapes, each dtype on the kernels ``linear_kernel`` allows, and casts to bf16 if that
    wins."""
    from ..assets import load_target

    check_linear_kernel(linear_kernel)
    if choice != "auto":
        return load_target(name_or_path, gguf_file, dtype=resolve_dtype(choice, workload="decode"))
    target, tokenizer = load_target(name_or_path, gguf_file, dtype=torch.float32)
    dtype = resolve_dtype(choice, next(target.parameters()).device, workload="decode", config=target.config,
                          kernels=decode_probe_kernels(linear_kernel))
    return target.to(dtype), tokenizer
