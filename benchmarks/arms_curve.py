"""Held-out tau of training arms against CPU minutes, from ``heldout_tau.py`` reports taken along the runs.

    python benchmarks/arms_curve.py --arm fresh=runs/init_s38_fresh --arm target=runs/init_s38_target \
        --at 2000=REPORT,REPORT --at 5000=REPORT,REPORT [--head export_ema] --output NAME

Each ``--at STEP=FILES`` names the held-out reports (any prompt slices) taken when the arms' exports held
their weights after STEP steps; an arm's tau there is pooled over those reports (committed tokens over
rounds, per set), its CPU minutes and block positions come from the run's history at STEP.
Writes benchmarks/results/NAME.{json,md,png}: tau per set against training minutes, one line per arm.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, save, table  # noqa: E402

from hf_dflash2.charts import save_chart  # noqa: E402

SETS = ("humaneval", "mtbench")


def parse_pairs(values: list[str], what: str) -> dict[str, str]:
    pairs = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key or not rest:
            raise SystemExit(f"--{what} {value!r}: expected NAME=VALUE")
        if key in pairs:
            raise SystemExit(f"--{what} {value!r}: {key} is given twice")
        pairs[key] = rest
    return pairs


def history_at(run: Path, step: int) -> dict:
    """The history entry of ``step`` (a resumed run keeps its whole history; an older copy may hold it)."""
    for name in ("history.json", *sorted(p.name for p in run.glob("history_*.json"))):
        path = run / name
        if path.exists():
            entry = next((h for h in json.loads(path.read_text()) if h["step"] == step), None)
            if entry is not None:
                return entry
    raise SystemExit(f"{run}: no history entry for step {step}")


def pooled_tau(reports: list[dict], head: str) -> dict[str, float]:
    out = {}
    for name in SETS:
        committed = sum(r["results"][head][name]["committed"] for r in reports)
        rounds = sum(r["results"][head][name]["rounds"] for r in reports)
        out[name] = committed / rounds
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", action="append", required=True, help="NAME=RUN_FOLDER")
    parser.add_argument("--at", action="append", required=True, help="STEP=REPORT[,REPORT...]")
    parser.add_argument("--head", default="export_ema", help="the export evaluated in each run folder")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    arms = {name: Path(folder) for name, folder in parse_pairs(args.arm, "arm").items()}
    points = {}
    for step, files in parse_pairs(args.at, "at").items():
        if not step.isdigit():
            raise SystemExit(f"--at {step}=...: STEP must be a whole number of steps")
        points[int(step)] = [json.loads(Path(f).read_text()) for f in files.split(",")]
    rows = []
    for name, run in arms.items():
        for step, reports in sorted(points.items()):
            key = f"{run}/{args.head}"
            missing = [i for i, r in enumerate(reports) if key not in r["results"]]
            if missing:
                raise SystemExit(f"--at {step}: {key} is not in report(s) {missing}")
            entry = history_at(run, step)
            tau = pooled_tau(reports, key)
            rows.append({"arm": name, "step": step, "train_minutes": round(entry["train_seconds"] / 60, 1),
                         "block_positions": entry.get("block_positions"),
                         **{f"tau_{s}": round(tau[s], 3) for s in SETS}})
    command = "python benchmarks/arms_curve.py " + " ".join(sys.argv[1:])
    save(args.output, {"command": command, "head": args.head, "rows": rows})
    columns = ["arm", "step", "train_minutes", "block_positions", *(f"tau_{s}" for s in SETS)]
    text = f"{command}\n\nHeld-out tau ({args.head}) pooled over the reports at each step\n\n" + table(rows, columns)
    (RESULTS / f"{args.output}.md").write_text(text + "\n")
    print(text)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, name in zip(axes, SETS):
        for arm in arms:
            series = [r for r in rows if r["arm"] == arm]
            ax.plot([r["train_minutes"] for r in series], [r[f"tau_{name}"] for r in series], marker="o", label=arm)
        ax.set_title(name)
        ax.set_xlabel("CPU minutes (one thread)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"held-out tau ({args.head})")
    axes[0].legend()
    fig.tight_layout()
    save_chart(fig, RESULTS / f"{args.output}.png", dpi=100)


if __name__ == "__main__":
    main()
