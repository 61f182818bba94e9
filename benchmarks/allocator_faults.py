"""Training step time and page faults with glibc's default allocator settings against the trainer's
(``hf_dflash2/allocator.py``: freed memory stays mapped), on the long run's recipe and store.

    python benchmarks/allocator_faults.py [--store data/store_s38] [--steps 40] [--rounds 2] [--threads 2]

Each setting trains a fresh head in its own process (a process cannot go back to glibc's adaptive
thresholds once they are set), alternating release, retain, release, retain, ... so that drift hits both;
the first ``--skip`` steps of each process (loading, warm caches) are left out. Writes
``benchmarks/results/allocator_faults_<cpu kind>.{json,md,png}``. Run it with nothing else on the cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, chart_grouped, cpu_kind, save, table  # noqa: E402

RECIPE = ("--target-layer-ids 1,7,14,20,27 --max-length 832 --warmup-steps 60 --batch-size 2 --anchors 64 "
          "--lr 1e-3 --label-source argmax --layers 2 --block-size 8 --selector-rank 128 --draft-vocab-size 8192 "
          "--mask-token-id 0 --output-scale 0.1 --logit-ramp-steps 0 --ema-decay 0.998 --eval-every 100000 "
          "--checkpoint-every 100000 --log-every 100000 --seed 0 --init-layers-from-target last").split()


def child(args) -> None:
    """Train ``--steps`` steps and write each step's seconds and minor page faults to ``--child``."""
    from hf_dflash2.allocator import minor_page_faults
    from hf_dflash2.cli import main
    from hf_dflash2.training.trainer import Trainer

    steps, train_step = [], Trainer.train_step

    def timed_step(self):
        faults, started = minor_page_faults(), time.perf_counter()
        record = train_step(self)
        steps.append({"seconds": time.perf_counter() - started, "faults": minor_page_faults() - faults})
        return record

    Trainer.train_step = timed_step
    with tempfile.TemporaryDirectory() as output:
        main(["train", "--store", args.store, *RECIPE, "--steps", str(args.steps), "--threads", str(args.threads),
              "--output", output, *(["--release-freed-memory"] if args.setting == "release" else [])])
    Path(args.child).write_text(json.dumps(steps))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="data/store_s38")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=8, help="first steps of each process left out")
    parser.add_argument("--rounds", type=int, default=2, help="processes per setting")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--setting", choices=["release", "retain"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not Path(args.store).is_dir():
        raise SystemExit(f"--store {args.store}: no such store (make store-smollm2-s38 builds it)")
    if args.skip >= args.steps:
        raise SystemExit(f"--skip {args.skip} leaves none of --steps {args.steps}")
    if args.child:
        child(args)
        return 0
    runs: dict[str, list[dict]] = {"release": [], "retain": []}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for setting in ("release", "retain") if round_ % 2 == 0 else ("retain", "release"):
                out = Path(scratch) / f"{setting}{round_}.json"
                subprocess.run([sys.executable, __file__, "--store", args.store, "--steps", str(args.steps),
                                "--threads", str(args.threads), "--setting", setting, "--child", str(out)],
                               check=True, stdout=subprocess.DEVNULL)
                runs[setting] += json.loads(out.read_text())[args.skip:]
                print(f"round {round_} {setting}: median step "
                      f"{statistics.median(s['seconds'] for s in runs[setting]):.3f} s", flush=True)
    rows = [{"allocator": setting, "median step (s)": statistics.median(s["seconds"] for s in steps),
             "median faults per step": statistics.median(s["faults"] for s in steps), "steps": len(steps)}
            for setting, steps in runs.items()]
    speedup = rows[0]["median step (s)"] / rows[1]["median step (s)"]
    columns = ["allocator", "median step (s)", "median faults per step", "steps"]
    text = table(rows, columns) + f"\n\nretain is {speedup:.3f}x release (median step time)\n"
    print(text)
    name = f"allocator_faults_{cpu_kind()}"
    save(name, {"command": " ".join(sys.argv), "rows": rows, "speedup": speedup, "runs": runs,
                "threads": args.threads, "store": args.store})
    (RESULTS / f"{name}.md").write_text(f"`python {' '.join(sys.argv)}`\n\n{text}")
    chart_grouped(["median step (s)"], {r["allocator"]: [r["median step (s)"]] for r in rows}, "seconds",
                  f"training step, glibc default vs freed memory kept ({cpu_kind()})", RESULTS / f"{name}.png",
                  baseline=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
