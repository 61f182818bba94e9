"""Held-out tau against training compute for one run: what more compute would buy.

Reads the run's evaluation points (the trainer evaluates every ``--eval-every`` steps on held-out
HumanEval / MT-Bench prompts with a fixed block) from ``history.json`` or, for a run still going, from its
checkpoint, and writes ``tau_curve.json`` and ``tau_curve.png`` (tau against block positions trained,
with the CPU minutes of each point) in ``--output`` (default benchmarks/results/<cpu kind>/).

    python benchmarks/training/tau_curve.py runs/flagship
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hf_dflash2.charts import save_chart

BENCHMARKS = Path(__file__).resolve().parents[1]


def load_history(run: Path) -> list[dict]:
    if (run / "history.json").exists():
        return json.loads((run / "history.json").read_text())
    checkpoint = run / "checkpoint.pt"
    if not checkpoint.exists():
        raise SystemExit(f"{run}: neither history.json nor checkpoint.pt (is this a training run folder?)")
    import torch

    return torch.load(checkpoint, map_location="cpu", weights_only=False)["history"]


def curve(history: list[dict]) -> list[dict]:
    return [
        {
            "step": r["step"],
            "block_positions": r.get("block_positions"),
            "train_minutes": round(r.get("train_seconds", 0.0) / 60, 1),
            "heldout_tau": round(r["eval_tau"], 3),
            "per_position": [round(x, 3) for x in r.get("eval_per_position", [])[:6]],
            "loss": round(r["loss"], 3),
        }
        for r in history
        if "eval_tau" in r
    ]


def draw(points: list[dict], title: str, path: Path, extra: dict[str, list[dict]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, series in {title: points, **(extra or {})}.items():
        xs = [p["block_positions"] / 1e6 for p in series]
        ax.plot(xs, [p["heldout_tau"] for p in series], marker="o", label=label)
    for p in points:
        ax.annotate(
            f"{p['train_minutes']:.0f} min",
            (p["block_positions"] / 1e6, p["heldout_tau"]),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=7,
        )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("block positions trained (millions)")
    ax.set_ylabel("held-out tau (greedy, fixed block)")
    ax.set_title("Held-out tau against training compute")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_chart(fig, path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("--compare", type=Path, nargs="*", default=[], help="other runs drawn on the same axes")
    parser.add_argument("--continued-by", type=Path, nargs="*", default=[],
                        help="runs each started from the previous one's last checkpoint (--init-from), in order: "
                        "drawn one after the other, offset by the block positions and minutes before them")
    parser.add_argument("--output", type=Path, default=None, help="folder (default: benchmarks/results/<cpu kind>/)")
    args = parser.parse_args()
    history = load_history(args.run)
    points = curve(history)
    if not points:
        raise SystemExit(f"{args.run}: no evaluation points yet (train with --eval-every)")
    extra = {str(run): curve(load_history(run)) for run in args.compare}
    last_points, last_history, base_positions, base_minutes = points, history, 0, 0.0
    for run in args.continued_by:
        base_positions += last_history[-1].get("block_positions", 0)
        base_minutes += last_history[-1].get("train_seconds", 0.0) / 60
        run_history = load_history(run)
        continued = [
            dict(p, block_positions=p["block_positions"] + base_positions,
                 train_minutes=round(p["train_minutes"] + base_minutes, 1))
            for p in curve(run_history)
        ]
        if not continued:
            raise SystemExit(f"{run}: no evaluation points yet (train with --eval-every)")
        extra[f"{run} (from step {last_history[-1]['step']})"] = [last_points[-1], *continued]
        last_points, last_history = continued, run_history
    if args.output is None:
        sys.path.insert(0, str(BENCHMARKS))
        from _common import results_dir

        args.output = results_dir()
    args.output.mkdir(parents=True, exist_ok=True)
    report = {
        "command": " ".join(["python", "benchmarks/training/tau_curve.py"] + sys.argv[1:]),
        "run": str(args.run),
        "points": points,
        "compare": extra,
    }
    (args.output / "tau_curve.json").write_text(json.dumps(report, indent=1))
    draw(points, str(args.run), args.output / "tau_curve.png", extra)
    for p in points:
        print(
            f"step {p['step']:5d}  {p['block_positions'] / 1e6:6.2f}M positions  {p['train_minutes']:6.1f} min  "
            f"tau {p['heldout_tau']:.2f}  pos1..: {p['per_position']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
