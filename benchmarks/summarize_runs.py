"""Training runs side by side at equal step or equal wall time, from their checkpoints' histories.

For short diagnostic arms (killed early, no held-out evaluation yet) the training batch's metrics are
what there is: each step draws sequences the run has not trained on yet (one epoch is ~1,500 steps of
2 sequences), so the batch's position-1 accuracy against the target's argmax is an unseen-data figure.
Metrics are averaged over a window of steps to tame the batch noise; held-out tau is shown when the run
evaluated.

    python benchmarks/summarize_runs.py runs/ab/* --at-step 150 --output benchmarks/results/diagnostic_arms
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def history_of(run: Path) -> list[dict]:
    if (run / "history.json").exists():
        return json.loads((run / "history.json").read_text())
    if (run / "checkpoint.pt").exists():
        return torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=False)["history"]
    raise SystemExit(f"{run}: neither history.json nor checkpoint.pt")


def window(history: list[dict], at_step: int | None, at_seconds: float | None, width: int) -> list[dict]:
    if at_step is not None:
        end = next((i for i, r in enumerate(history) if r["step"] >= at_step), None)
    else:
        end = next((i for i, r in enumerate(history) if r.get("train_seconds", 0) >= at_seconds), None)
    if end is None:
        return []
    return history[max(0, end - width + 1) : end + 1]


def summarize(run: Path, at_step, at_seconds, width) -> dict | None:
    history = history_of(run)
    rows = window(history, at_step, at_seconds, width)
    if not rows:
        return None
    evals = [r for r in history if "eval_tau" in r and r["step"] <= rows[-1]["step"]]

    def mean(key):
        values = [r[key] for r in rows if key in r]
        return round(sum(values) / len(values), 3) if values else None

    return {
        "run": run.name,
        "step": rows[-1]["step"],
        "block_positions": rows[-1].get("block_positions"),
        "train_seconds": round(rows[-1].get("train_seconds", 0)),
        "unary_loss": mean("unary_loss"),
        "selector_loss": mean("selector_loss"),
        "top1_position1": mean("top1_position1"),
        "max_grad_norm": round(max(r["grad_norm"] for r in rows), 2),
        "heldout_tau": round(evals[-1]["eval_tau"], 3) if evals else None,
        "heldout_tau_step": evals[-1]["step"] if evals else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--at-step", type=int)
    group.add_argument("--at-seconds", type=float)
    parser.add_argument("--window", type=int, default=30, help="steps averaged, ending at the cut")
    parser.add_argument("--output", type=Path, default=None, help="writes OUTPUT.json and OUTPUT.md")
    args = parser.parse_args()
    rows = []
    for run in args.runs:
        row = summarize(run, args.at_step, args.at_seconds, args.window)
        if row is None:
            print(f"{run}: its history does not reach the cut, left out")
        else:
            rows.append(row)
    cut = f"step {args.at_step}" if args.at_step is not None else f"{args.at_seconds:.0f} s of training"
    lines = [
        f"At {cut}; batch metrics averaged over the last {args.window} steps.",
        "",
        "| run | step | block positions | s | unary loss | selector loss | pos-1 acc | max grad norm | held-out tau |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tau = "" if r["heldout_tau"] is None else f"{r['heldout_tau']:.3f} (step {r['heldout_tau_step']})"
        lines.append(
            f"| {r['run']} | {r['step']} | {r['block_positions'] or 0:,} | {r['train_seconds']} | {r['unary_loss']} | "
            f"{r['selector_loss']} | {r['top1_position1']} | {r['max_grad_norm']} | {tau} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/summarize_runs.py " + " ".join(
            [str(r) for r in args.runs] + [f"--{'at-step' if args.at_step is not None else 'at-seconds'}",
                                           str(args.at_step if args.at_step is not None else args.at_seconds)])
        args.output.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
        args.output.with_suffix(".md").write_text(f"`{command}`\n\n{table}\n")


if __name__ == "__main__":
    main()
