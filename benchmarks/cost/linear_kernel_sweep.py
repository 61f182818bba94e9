"""A target forward over k new tokens on each CPU linear kernel: where the verify's cost comes from.

    python benchmarks/cost/linear_kernel_sweep.py [--dtype fp32|bf16] [--repeats 7]

SmolLM2-135M-Instruct with a 200-token cache: the forward over k = 1, 2, 4, 8, 16 new tokens (cropped
back after each), on PyTorch's default linear kernel and on oneDNN with packed weights, interleaved,
medians of ``--repeats``; and one 576 -> 1536 linear layer at 1 and 2 rows. Checks that both kernels
give the same argmax. Writes benchmarks/results/<cpu kind>/linear_kernel_sweep_<dtype>.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import results_dir, save, table  # noqa: E402

from hf_dflash2.assets import load_target  # noqa: E402
from hf_dflash2.cpu.linear_kernels import KernelSwitch  # noqa: E402

KERNELS = KernelSwitch.kernels
WIDTHS = (1, 2, 4, 8, 16)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    target, _ = load_target(dtype=dtype)
    switch = KernelSwitch(target)
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, 40000, (1, 200), generator=generator)
    samples = {(kernel, k): [] for kernel in KERNELS for k in WIDTHS}
    layer = torch.nn.Linear(576, 1536, bias=False).to(dtype)
    layer_switch = KernelSwitch(layer)
    with torch.inference_mode():
        cache = target(context, use_cache=True).past_key_values
        probe = torch.randint(0, 40000, (1, 16), generator=generator)
        argmax = {}
        for kernel in KERNELS:
            switch.use(kernel)
            argmax[kernel] = target(probe, past_key_values=cache, use_cache=True).logits.argmax(-1)
            cache.crop(-16)
        for repeat in range(args.repeats + 1):  # the first pass picks kernels and is not counted
            for k in WIDTHS:
                ids = torch.randint(0, 40000, (1, k), generator=generator)
                for kernel in KERNELS if repeat % 2 else reversed(KERNELS):
                    switch.use(kernel)
                    started = time.perf_counter()
                    target(ids, past_key_values=cache, use_cache=True)
                    if repeat:
                        samples[kernel, k].append(time.perf_counter() - started)
                    cache.crop(-k)
        layer_times = {}
        for rows in (1, 2):
            x = torch.randn(rows, 576, dtype=dtype)
            for kernel in KERNELS:
                layer_switch.use(kernel)
                runs = []
                for _ in range(41):
                    started = time.perf_counter()
                    layer(x)
                    runs.append(time.perf_counter() - started)
                layer_times[kernel, rows] = statistics.median(runs[1:])
    rows = []
    for kernel in KERNELS:
        one = statistics.median(samples[kernel, 1])
        rows.append({"kernel": kernel, **{f"k={k} (ms)": round(statistics.median(samples[kernel, k]) * 1000, 1)
                                          for k in WIDTHS},
                     "k=16 / k=1": round(statistics.median(samples[kernel, 16]) / one, 2),
                     "576->1536 layer, 1 row (us)": round(layer_times[kernel, 1] * 1e6),
                     "2 rows (us)": round(layer_times[kernel, 2] * 1e6)})
    same = bool(torch.equal(argmax["default"], argmax["onednn"]))
    command = "python benchmarks/cost/linear_kernel_sweep.py " + " ".join(sys.argv[1:])
    markdown = (f"Target forward over k new tokens, 200-token cache, {args.dtype}, medians of {args.repeats} "
                f"(`{command}`); same argmax on both kernels: {same}\n\n{table(rows, list(rows[0]))}\n")
    stem = f"linear_kernel_sweep_{args.dtype}"
    save(stem, {"command": command, "rows": rows, "same_argmax": same})
    (results_dir() / f"{stem}.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
