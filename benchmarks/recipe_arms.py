"""Recipe search at a small budget: short training arms compared on held-out tau, not on training loss.

Every arm trains on the same first ``--sequences`` sequences of one feature store (the store appends in a
fixed order, so a growing store does not change an arm's data), for the same number of block positions
(batch x anchors x positions per step is held fixed), with the same seed; then the trainer's
evaluation runs the greedy speculative loop with a fixed block on held-out prompts (alternating
HumanEval and MT-Bench, never in the training data) and reports tau.

Arms run as ``hf-dflash2 train`` subprocesses, ``--parallel`` at a time with one thread each, and are
resumable: an arm whose run folder already holds a finished ``history.json`` is read, not rerun.

    python benchmarks/recipe_arms.py --store data/store_sharegpt --sequences 1200 --steps 150
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hf_dflash2.charts import save_chart

ROOT = Path(__file__).resolve().parents[1]

# name -> train flags that differ from the base arm. The base (this round's recipe, see README "Training"):
# KL to the target's top-32, 2 layers, B = 8, standardized features, output norm at 0.1 of the target's.
ARMS = {
    "base: kl, 2 layers, B=8": [],
    "labels: data tokens": ["--label-source", "data"],
    "labels: target argmax": ["--label-source", "argmax"],
    "1 layer": ["--layers", "1"],
    "3 layers": ["--layers", "3"],
    "block size 16": ["--block-size", "16"],
    "lr 3e-3": ["--lr", "3e-3"],
    "128 anchors x 1 sequence": ["--anchors", "128", "--batch-size", "1"],
    "raw features (no standardizing)": ["--raw-features"],
    "full output scale + logit ramp": ["--output-scale", "1.0", "--logit-ramp-steps", "20"],
    "DFlash-1 (no conv, no selector)": ["--dflash1"],
}
BASE = [
    "--label-source",
    "kl",
    "--layers",
    "2",
    "--block-size",
    "8",
    "--lr",
    "1e-3",
    "--anchors",
    "64",
    "--batch-size",
    "2",
    "--selector-rank",
    "128",
    "--mask-token-id",
    "0",
    "--output-scale",
    "0.1",
    "--logit-ramp-steps",
    "0",
    "--warmup-steps",
    "20",
]


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")[:40]


def arm_command(args, name: str, flags: list[str]) -> list[str]:
    merged = dict(zip(BASE[::2], BASE[1::2]))
    extra = []
    i = 0
    while i < len(flags):
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            merged[flags[i]] = flags[i + 1]
            i += 2
        else:
            extra.append(flags[i])
            i += 1
    block = int(merged["--block-size"])
    # Same block positions per step in every arm: a B = 16 arm sees proportionally fewer anchors.
    if block != 8 and "--anchors" not in flags:
        merged["--anchors"] = str(max(1, int(merged["--anchors"]) * 7 // (block - 1)))
    command = [
        sys.executable,
        "-m",
        "hf_dflash2.cli",
        "train",
        "--store",
        args.store,
        "--output",
        str(args.runs / slug(name)),
        "--max-sequences",
        str(args.sequences),
        "--steps",
        str(args.steps),
        "--eval-every",
        str(args.steps),
        "--eval-prompts",
        str(args.eval_prompts),
        "--eval-max-new-tokens",
        str(args.eval_tokens),
        "--checkpoint-every",
        "25",
        "--log-every",
        "25",
        "--seed",
        "0",
        "--threads",
        "1",
        "--resume",
        "--draft-vocab-size",
        str(args.draft_vocab_size),
        "--mixed-precision",
        args.mixed_precision,
    ]
    for flag, value in merged.items():
        command += [flag, value]
    return command + extra


def finished(run: Path) -> dict | None:
    history = run / "history.json"
    if not history.exists():
        return None
    records = json.loads(history.read_text())
    evals = [r for r in records if "eval_tau" in r]
    return evals[-1] if evals else None


def run_arms(args, names: list[str]) -> None:
    queue = [n for n in names if finished(args.runs / slug(n)) is None]
    running: list[tuple[str, subprocess.Popen]] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    while queue or running:
        while queue and len(running) < args.parallel:
            name = queue.pop(0)
            (args.runs / slug(name)).mkdir(parents=True, exist_ok=True)
            log = open(args.runs / slug(name) / "train.log", "a")
            print(f"start  {name}", flush=True)
            running.append(
                (name, subprocess.Popen(arm_command(args, name, ARMS[name]), cwd=ROOT, env=env, stdout=log, stderr=log))
            )
        time.sleep(5)
        for name, process in list(running):
            if process.poll() is not None:
                print(f"done   {name} (exit {process.returncode})", flush=True)
                running.remove((name, process))


def collect(args, names: list[str]) -> dict:
    rows = []
    for name in names:
        result = finished(args.runs / slug(name))
        if result is None:
            continue
        rows.append(
            {
                "arm": name,
                "flags": ARMS[name],
                "heldout_tau": round(result["eval_tau"], 3),
                "per_position": [round(x, 3) for x in result.get("eval_per_position", [])[:6]],
                "final_loss": round(result["loss"], 3),
                "block_positions": result.get("block_positions"),
                "train_minutes": round(result.get("train_seconds", 0) / 60, 1),
            }
        )
    return {
        "command": " ".join(["python", "benchmarks/recipe_arms.py"] + sys.argv[1:]),
        "store": args.store,
        "sequences": args.sequences,
        "steps": args.steps,
        "eval": f"greedy fast loop, fixed block, {args.eval_prompts} held-out prompts "
        f"(HumanEval/MT-Bench alternating), {args.eval_tokens} new tokens",
        "note": f"arms ran {args.parallel} at a time, one thread each, on a 2-core CPU shared with other work: "
        "minutes are not comparable, block positions are",
        "arms": rows,
    }


def write_results(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe_arms.json").write_text(json.dumps(report, indent=1))
    lines = [
        "| arm | held-out tau | acceptance pos 1..6 | final loss | block positions | minutes |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["arms"]:
        lines.append(
            f"| {row['arm']} | {row['heldout_tau']:.2f} | {', '.join(f'{x:.2f}' for x in row['per_position'])} | "
            f"{row['final_loss']:.2f} | {row['block_positions']:,} | {row['train_minutes']} |"
        )
    table = "\n".join(lines)
    (out / "recipe_arms.md").write_text(f"`{report['command']}`\n\n{report['eval']}\n\n{table}\n")
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(report["arms"]) + 1.2))
    names = [r["arm"] for r in report["arms"]][::-1]
    ax.barh(names, [r["heldout_tau"] for r in report["arms"]][::-1], color="#4c72b0")
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("held-out tau (fixed block, greedy)")
    ax.set_title(f"Recipe arms: equal block positions ({report['steps']} steps), same data and seed")
    fig.tight_layout()
    save_chart(fig, out / "recipe_arms.png", dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", default="data/store_sharegpt")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "arms")
    parser.add_argument("--sequences", type=int, default=1200)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-prompts", type=int, default=8)
    parser.add_argument("--eval-tokens", type=int, default=64)
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--mixed-precision", default="auto")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--arms", default=None, help="comma-separated arm slugs to run (default: all)")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    names = list(ARMS)
    if args.arms:
        wanted = args.arms.split(",")
        unknown = [w for w in wanted if w not in {slug(n) for n in names}]
        if unknown:
            raise SystemExit(f"--arms: unknown {unknown}; known: {[slug(n) for n in names]}")
        names = [n for n in names if slug(n) in wanted]
    run_arms(args, names)
    write_results(collect(args, list(ARMS)), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
