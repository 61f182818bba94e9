"""The cost model measured with and without the loop's padding mask, on each attention.

    python benchmarks/cost_model_mask.py [--dtype auto|bf16|fp32] [--repeats 2]

``measure_cost_model`` times the target's verify forwards. The fast loop's forwards at batch > 1 carry a
2-D mask with padding (left-padded prompts, holes where rows accepted less), and which SDPA kernel runs
depends on it: without a mask, a one-token forward of a grouped-query target on Transformers' ``sdpa``
runs SDPA's ``enable_gqa``; with one, Transformers packs the query heads itself. Since cost-model version 5
the measurement pads at batch > 1 (``padded=None``). This script measures both ways (``padded=False``: the
version-4 measurement), at batch 8 and 1, on ``sdpa`` and on the packed attention
(``hf_dflash2.attention``), interleaved, and prints ``verify(1)`` in ms and each ``verify(k) / verify(1)``,
the ratios the adaptive policy plans with. In the dtype ``auto`` decodes in, on the linear kernel ``auto``
picks. Writes benchmarks/results/cost_model_mask_<cpu kind>[_<dtype>].{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, cpu_kind, save, table  # noqa: E402

from hf_dflash2.attention import packed_gqa_attention  # noqa: E402
from hf_dflash2.bench import rotated  # noqa: E402
from hf_dflash2.cost_model_dflash2 import linear_kernel_of, measure_cost_model  # noqa: E402
from hf_dflash2.precision import load_target_for_decoding  # noqa: E402
from hf_dflash2.prompts import default_head, load_head  # noqa: E402

SHOWN = (2, 4, 8, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--repeats", type=int, default=2, help="measurements of each arm (each: medians of 3)")
    args = parser.parse_args()
    target, _ = load_target_for_decoding(args.dtype)
    head = load_head(default_head(), target)
    rows = []
    for batch in (8, 1):
        for packed in (False, True):
            with packed_gqa_attention(target, packed):
                attention = target.config._attn_implementation
                measured = {False: [], True: []}
                for repeat in range(args.repeats):
                    for padded in rotated([False, True], repeat):
                        model = measure_cost_model(target, head, batch_size=batch, block_size=16, padded=padded,
                                                   context_length=256)
                        measured[padded].append(model.verify_seconds)
            for padded, runs in measured.items():
                seconds = [statistics.median(run[k] for run in runs) for k in range(16)]
                row = {"batch": batch, "attention": attention, "mask": "padded" if padded else "none (version 4)",
                       "verify_1_ms": seconds[0] * 1e3}
                row.update({f"k={k}": seconds[k - 1] / seconds[0] for k in SHOWN})
                rows.append(row)
                print(row, flush=True)
    suffix = "" if args.dtype == "auto" else f"_{args.dtype}"
    name = f"cost_model_mask_{cpu_kind()}{suffix}"
    command = "python benchmarks/cost_model_mask.py" + (f" --dtype {args.dtype}" if args.dtype != "auto" else "")
    save(name, {"command": command, "dtype": str(target.dtype), "linear_kernel": linear_kernel_of(target),
                "rows": rows})
    columns = ["batch", "attention", "mask", "verify_1_ms", *(f"k={k}" for k in SHOWN)]
    text = (f"{command}\n\nSmolLM2-135M-Instruct {target.dtype}, linear kernel {linear_kernel_of(target)}, the "
            f"committed head, 256 tokens of context, medians of {args.repeats} measurements; k=n: "
            f"verify(n) / verify(1)\n\n{table(rows, columns)}\n")
    (RESULTS / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
