"""Helpers shared by the benchmark scripts: interleaved timing, medians, JSON + table output.

Every script imports this module by putting ``benchmarks/`` on ``sys.path`` (the scripts live one folder down,
in ``speed/``, ``cost/`` and ``training/``), and writes its results to ``benchmarks/results/<cpu kind>/``: one
folder per kind of CPU, where a rerun replaces the previous result of the same benchmark and settings (git
keeps the history). See docs/benchmarks.md. ``python benchmarks/_common.py`` prints this CPU's kind (the
Makefile's result folder); torch and this package are imported only where a helper needs them, so that is quick."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
RESULTS_ROOT = BENCHMARKS / "results"
# Plain greedy for Transformers' generate, overriding sampling defaults a generation_config may carry.
GREEDY = dict(do_sample=False, top_k=None, top_p=None, temperature=None)


def cpu_kind() -> str:
    """A short name for this CPU's fastest bf16 path, the folder of its results: "amx", "avx512bf16" (AMD:
    "avx512bf16_zen4" / "_zen5"), "avx512" (AVX-512 without bf16) or "avx2" (a checkout may run on CPUs of
    several kinds, and results of one kind must not overwrite another's)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    kind = ("amx" if "amx_bf16" in flags else "avx512bf16" if "avx512_bf16" in flags
            else "avx512" if "avx512f" in flags else "avx2")
    if kind == "avx512bf16":  # AMD Zen 4 (family 25) and Zen 5 (26) share the flags, not the speed
        family = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("cpu family")),
                      "")
        kind += {"25": "_zen4", "26": "_zen5"}.get(family, "")
    return kind


def machine() -> dict:
    import torch

    from hf_dflash2.cost_model_dflash2 import _device_name

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu": _device_name(torch.device("cpu")), "cpu_kind": cpu_kind(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def interleaved(candidates: dict, repeats: int, warmup: int = 1) -> dict:
    """Median seconds of each callable, timed round-robin so drift hits all of them alike; the order is
    rotated every repeat, so that no callable always runs right after the same other one."""
    from hf_dflash2.evaluation.bench import rotated

    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in candidates}
    for repeat in range(repeats):
        for name in rotated(list(candidates), repeat):
            fn = candidates[name]
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(ts) for name, ts in times.items()}


def results_dir() -> Path:
    """``benchmarks/results/<cpu kind>/``, created if missing: where this machine's results go."""
    path = RESULTS_ROOT / cpu_kind()
    path.mkdir(parents=True, exist_ok=True)
    return path


def save(name: str, payload: dict) -> Path:
    """Writes ``results_dir() / name.json``: the payload with this machine's description."""
    if Path(name).name != name:
        raise ValueError(f"a result's name is a file stem under {RESULTS_ROOT}/<cpu kind>/, not a path: {name!r}")
    path = results_dir() / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=1) + "\n")
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for c in columns:
            v = row.get(c, "")
            cells.append(f"{v:.3f}" if isinstance(v, float) else "" if v is None else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart_bars(labels: list[str], values: list[float], ylabel: str, title: str, path: Path) -> None:
    """A plain bar chart (PNG) of one value per label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hf_dflash2.charts import save_chart

    fig, ax = plt.subplots(figsize=(max(5, len(labels) * 1.1), 3.4))
    ax.bar(range(len(values)), values, color="#2a7")
    ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=20)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    save_chart(fig, path, dpi=110)
    plt.close(fig)


def chart_grouped(labels: list[str], series: dict[str, list[float]], ylabel: str, title: str, path: Path,
                  baseline: float | None = 1.0) -> None:
    """Grouped bars (PNG): one group per label, one bar per series, and a line at ``baseline``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hf_dflash2.charts import save_chart

    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 0.3 * (len(series) + 1)) + 2.5, 3.6))  # + the legend
    for i, (name, values) in enumerate(series.items()):
        ax.bar([p + (i - (len(series) - 1) / 2) * width for p in range(len(labels))], values, width=width, label=name)
    if baseline is not None:
        ax.axhline(baseline, color="black", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside the bars
    fig.tight_layout()
    save_chart(fig, path, dpi=110)
    plt.close(fig)


def fp32_committed_head(load_committed: bool = True):
    """(target, tokenizer, head): SmolLM2-135M-Instruct in fp32 (every variant's greedy text is then the
    same) with the committed dFlash 2 head (None when not ``load_committed``), prompts in the chat
    template."""
    from hf_dflash2.cpu.precision import load_target_for_decoding
    from hf_dflash2.prompts import apply_chat_template_option, default_head, load_head

    target, tokenizer = load_target_for_decoding("fp32", None, None)
    apply_chat_template_option(tokenizer, "auto")
    return target, tokenizer, load_head(default_head("smollm2-135m-dflash2"), target) if load_committed else None


def drafting_every_position(target, tokenizer, head, prompt: str, new_tokens: int, on_draft) -> list[int]:
    """Greedy decoding where every round is a plain step plus one draft of the head's (no n-gram, no
    trees), so its draft pass runs once at every generated position; ``on_draft(anchor_pos, draft)``
    sees each pass's ``DraftOutput`` -> the whole sequence's token ids."""
    from hf_dflash2 import speculative_generate
    from hf_dflash2.cost_model_dflash2 import ForcedVerifyLengths
    from hf_dflash2.prompts import encode_prompt

    draft_block = head.draft_block

    def recorded(anchor, anchor_pos, *rest, **kwargs):
        out = draft_block(anchor, anchor_pos, *rest, **kwargs)
        on_draft(int(anchor_pos[0]), out)
        return out

    head.draft_block = recorded
    try:
        ids = encode_prompt(tokenizer, prompt, target.device)
        out = speculative_generate(target, head, ids, max_new_tokens=new_tokens, ngram_size=0, draft_tree=False,
                                   verify_policy=ForcedVerifyLengths([1]), block_size=8)
    finally:
        head.draft_block = draft_block
    return out.sequences[0].tolist()


if __name__ == "__main__":
    print(cpu_kind())
