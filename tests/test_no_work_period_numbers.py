"""No work-period numbers in the product: names, code, comments, tests, recipes, configs and the heads' cards
say what a thing is, not when it was made. Compatibility notes name versions ("heads saved by 0.1.0 ..."). The
lab notebook, docs/history/, keeps its own dates."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIPPED_DIRS = ("docs/history/",)
SKIPPED_SUFFIXES = (".safetensors", ".png", ".pt", ".bin", ".gguf")
THIS_FILE = Path(__file__).resolve().relative_to(REPO).as_posix()

# Built from pieces, so that this file's own source holds none of the words it looks for.
_S, _R = "sess" + "ions?", "rou" + "nd"
WORK_PERIOD = re.compile(
    "|".join((
        rf"\b{_S}\s+\d+",  # a numbered work period, in prose ("... 30", "... 40-41")
        rf"(?<![A-Za-z]){_R}[ _]?\d+",  # a numbered round of work ("... 14", "tau_...41"); "rounds", "a ... of" pass
        r"(?<![A-Za-z0-9])[sS]\d{2}(?![0-9A-Za-z])",  # a short tag ("S26_STEPS", "store_s38", "-s40", "s29_gamma")
    )),
    re.IGNORECASE,
)


def work_period_references(text: str) -> list[str]:
    return [m.group(0) for m in WORK_PERIOD.finditer(text)]


@pytest.mark.parametrize("text", [
    "before " + "session 30", "Session 43: the long run", "over " + "sessions 40-41", "sessions  7",
    "heldout_tau_" + "round41.json", "ablation_" + "round7", "Round 14", "round_12", "S26" + "_STEPS",
    "make finetune-smollm2-" + "s29", "data/store_" + "s38", "runs/long_" + "s40_trunk", "s29" + "_gamma2",
    "bench_amx_" + "s41/", "cool-copy-smollm2-" + "s42:",
])
def test_the_pattern_catches_work_period_references(text):
    assert work_period_references(text), text


@pytest.mark.parametrize("text", [
    "a speculative round", "rounds of 8 tokens", "round-trip", "round(x, 3)", "each round's cost",
    "the session's budget", "a training session", "s1", "layer s3", "sha 3e2f4ea0", "0a151e8", "fp16s",
    "step 14,129", "x86_64", "slice0 ... slice9", "s123", "bf16", "posts12", "class S12Sampler",
    "version 0.1.0", "a 32-bit s",
])
def test_the_pattern_lets_ordinary_text_pass(text):
    assert not work_period_references(text), text


def _listed_files() -> list[str]:
    listed = set()
    for extra in ([], ["--others", "--exclude-standard"]):
        result = subprocess.run(["git", "ls-files", *extra], cwd=REPO, capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip("not a git checkout")
        listed.update(line for line in result.stdout.splitlines() if line)
    return sorted(listed)


def _text(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:  # listed by git but deleted in the work tree
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_file_names_a_work_period():
    found = []
    for name in _listed_files():
        if name == THIS_FILE or name.startswith(SKIPPED_DIRS) or name.endswith(SKIPPED_SUFFIXES):
            continue
        for match in work_period_references(name):
            found.append(f"{name}: (its path) {match!r}")
        text = _text(REPO / name)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            matches = work_period_references(line)
            if matches:
                found.append(f"{name}:{number}: {', '.join(repr(m) for m in matches)}: {line.strip()[:120]}")
    assert not found, f"{len(found)} work-period references (name what a thing is, or the version):\n" + "\n".join(
        found[:200]) + (f"\n... and {len(found) - 200} more" if len(found) > 200 else "")
