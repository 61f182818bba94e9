"""Held-out tau pooled over prompt slices, and each head's per-slice difference from a baseline head.

One slice (16 prompts) moves a head's tau by tenths (docs/training.md), so a choice made on one or two
slices is mostly noise, and the slice a head was chosen on flatters it. This pools the
``benchmarks/training/heldout_tau.py`` reports of several slices: per head and prompt set, tau over all the slices'
rounds (committed tokens / rounds), and against ``--baseline`` the mean per-slice difference with its standard
error, on the slices both were run on. A report's slice is its ``--prompt-slice`` (0 when absent). Held-out tau is
deterministic, so a head and slice found in two reports must agree; a disagreement is an error, not averaged away.

    python benchmarks/training/heldout_slices.py benchmarks/results/<cpu kind>/heldout_tau_slice[4-9].json \\
        --baseline heads/smollm2-135m-dflash2 --slices 4-9 --output benchmarks/results/<cpu kind>/heldout_slices
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
from pathlib import Path

from hf_dflash2.charts import save_chart

SETS = ("humaneval", "mtbench")


def recorded_options(report: dict, path: Path) -> dict[str, str]:
    """The ``--name value`` options of the ``heldout_tau.py`` command a report records."""
    argv = shlex.split(report.get("command", ""))
    if any(a.startswith("--") and "=" in a for a in argv):
        raise SystemExit(f"{path}: the recorded command writes an option as --name=value; expected --name value")
    return {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}


def protocol_of(report: dict, options: dict[str, str]) -> dict:
    """What a report measured besides its heads: tau is only comparable under one protocol per slice."""
    return {"--tokens": options.get("--tokens", "64"), "--dtype": options.get("--dtype", "fp32"),
            "--block-size": options.get("--block-size", "each head's own"), "prompts": report.get("prompts")}


def parse_slices(spec: str | None) -> set[int] | None:
    """``"1-5,7"`` -> {1, 2, 3, 4, 5, 7}; ``None`` -> every slice found."""
    if spec is None:
        return None
    chosen = set()
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if match is None or (match[2] is not None and int(match[2]) < int(match[1])):
            raise SystemExit(f"--slices {spec!r}: expected e.g. 1-9 or 1,3,5 (a range runs low-high)")
        chosen.update(range(int(match[1]), int(match[2] or match[1]) + 1))
    return chosen


def collect(paths: list[Path], slices: set[int] | None) -> dict[str, dict[int, dict]]:
    """head -> slice -> {set: {"rounds", "committed"}}, from every report."""
    table: dict[str, dict[int, dict]] = {}
    protocols: dict[int, tuple[dict, Path]] = {}
    for path in paths:
        report = json.loads(path.read_text())
        options = recorded_options(report, path)
        k = int(options.get("--prompt-slice", 0))
        if slices is not None and k not in slices:
            continue
        protocol = protocol_of(report, options)
        first, first_path = protocols.setdefault(k, (protocol, path))
        for field_name in protocol:
            if protocol[field_name] != first[field_name]:
                raise SystemExit(f"slice {k}: {path} was measured with {field_name} {protocol[field_name]!r}, "
                                 f"{first_path} with {first[field_name]!r}: tau under two protocols is not pooled")
        for head, by_set in report["results"].items():
            head = head.rstrip("/")
            cells = {s: {"rounds": by_set[s]["rounds"], "committed": by_set[s]["committed"]} for s in SETS}
            known = table.setdefault(head, {}).get(k)
            if known is not None and known != cells:
                raise SystemExit(f"{head} on slice {k}: {path} says {cells}, an earlier report {known}")
            table[head][k] = cells
    return table


def complete_heads(table: dict[str, dict[int, dict]], baseline: str | None) -> tuple[dict, dict[str, list[int]]]:
    """Only the heads run on every slice the baseline (or, without one, the most-run head) was run on: a head
    pooled over other slices is not comparable. Returns the kept table and the left-out heads' slices."""
    reference = set(table[baseline]) if baseline is not None else max((set(v) for v in table.values()), key=len)
    kept = {h: {k: v for k, v in by_slice.items() if k in reference} for h, by_slice in table.items()
            if reference <= set(by_slice)}
    return kept, {h: sorted(by_slice) for h, by_slice in table.items() if h not in kept}


def summarise(table: dict[str, dict[int, dict]], baseline: str | None) -> dict:
    summary = {}
    for head, by_slice in table.items():
        row = {"slices": sorted(by_slice)}
        for s in SETS:
            rounds = sum(c[s]["rounds"] for c in by_slice.values())
            row[s] = {"tau": round(sum(c[s]["committed"] for c in by_slice.values()) / rounds, 3)}
            if baseline is not None and baseline in table and head != baseline:
                shared = sorted(set(by_slice) & set(table[baseline]))
                diffs = [
                    by_slice[k][s]["committed"] / by_slice[k][s]["rounds"]
                    - table[baseline][k][s]["committed"] / table[baseline][k][s]["rounds"]
                    for k in shared
                ]
                if diffs:
                    mean = sum(diffs) / len(diffs)
                    spread = (
                        round(math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs)), 3)
                        if len(diffs) > 1 else None  # one slice: no spread to speak of (and NaN is not JSON)
                    )
                    row[s].update(
                        vs_baseline=round(mean, 3),
                        standard_error=spread,
                        slices_won=sum(d > 0 for d in diffs),
                        slices_compared=len(diffs),
                    )
        summary[head] = row
    return summary


def markdown(summary: dict, baseline: str | None) -> str:
    versus = "vs baseline: mean per-slice difference (± s.e., slices won)"
    lines = [f"| head | slices | HumanEval τ | {versus} | MT-Bench τ | {versus} |", "|---|---|---|---|---|---|"]
    for head, row in summary.items():
        cells = [head + (" (baseline)" if head == baseline else ""), f"{len(row['slices'])}"]
        for s in SETS:
            cell = row[s]
            cells.append(f"{cell['tau']:.3f}")
            if "vs_baseline" in cell:
                won = f"{cell['slices_won']}/{cell['slices_compared']}"
                spread = "—" if cell["standard_error"] is None else f"{cell['standard_error']:.3f}"
                cells.append(f"{cell['vs_baseline']:+.3f} ± {spread}, {won}")
            else:
                cells.append("—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def draw(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = list(summary)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(heads)), 4))
    width = 0.38
    for i, s in enumerate(SETS):
        values = [summary[h][s]["tau"] for h in heads]
        ax.bar([x + (i - 0.5) * width for x in range(len(heads))], values, width, label=s)
    ax.set_xticks(range(len(heads)))
    ax.set_xticklabels([Path(h).parent.name + "/" + Path(h).name for h in heads], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("held-out τ, pooled over slices")
    ax.set_ylim(1.0, None)
    ax.legend()
    fig.tight_layout()
    save_chart(fig, path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path, help="heldout_tau.py JSON reports")
    parser.add_argument("--baseline", default=None, help="the head to compare with, as reports name it")
    parser.add_argument("--slices", default=None, help="only these slices, e.g. 1-9 (default: every one found)")
    parser.add_argument("--output", type=Path, default=None, help="writes OUTPUT.json, OUTPUT.md and OUTPUT.png")
    args = parser.parse_args()
    missing = [str(p) for p in args.reports if not p.is_file()]
    if missing:
        raise SystemExit(f"no such report: {', '.join(missing)}")
    table = collect(args.reports, parse_slices(args.slices))
    if not table:
        raise SystemExit(f"no report holds a slice in --slices {args.slices}")
    if args.baseline is not None and args.baseline not in table:
        raise SystemExit(f"--baseline {args.baseline!r} is in no report; heads found: {sorted(table)}")
    table, left_out = complete_heads(table, args.baseline)
    summary = summarise(table, args.baseline)
    text = markdown(summary, args.baseline)
    if left_out:
        text += "\n\nLeft out, not run on every slice: " + "; ".join(f"{h} (slices {v})" for h, v in left_out.items())
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(["python", "benchmarks/training/heldout_slices.py"] + sys.argv[1:])
        args.output.with_suffix(".json").write_text(
            json.dumps({"command": command, "baseline": args.baseline, "heads": summary}, indent=1)
        )
        args.output.with_suffix(".md").write_text(f"`{command}`\n\n{text}\n")
        draw(summary, args.output.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
