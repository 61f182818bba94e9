"""benchmarks/shrink_pngs.py: a chart rewritten as a palette PNG shows the same pixels in fewer bytes."""

from __future__ import annotations

import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from .conftest import REPO  # noqa: E402

SCRIPT = REPO / "benchmarks" / "shrink_pngs.py"


def _chart(path):
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(["a", "b", "c"], [1.0, 2.5, 1.7], color=["#1f77b4", "#ff7f0e", "#2ca02c"])
    ax.plot([0, 1, 2], [1.2, 2.0, 1.1], "k--", label="line")
    ax.legend()
    ax.set_title("a chart")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def test_same_picture_fewer_bytes_and_a_second_run_changes_nothing(tmp_path):
    path = tmp_path / "chart.png"
    _chart(path)
    before_bytes = path.stat().st_size
    with Image.open(path) as image:
        before = np.asarray(image.convert("RGB")).astype(int)
    subprocess.run([sys.executable, str(SCRIPT), str(path)], check=True, capture_output=True)
    after_bytes = path.stat().st_size
    with Image.open(path) as image:
        assert image.mode == "P"
        after = np.asarray(image.convert("RGB")).astype(int)
    assert after_bytes < before_bytes
    assert after.shape == before.shape
    assert np.abs(after - before).max() <= 16  # the chart's colours exact, anti-aliasing shades close
    assert (np.abs(after - before).sum(-1) == 0).mean() > 0.95
    subprocess.run([sys.executable, str(SCRIPT), str(path)], check=True, capture_output=True)
    assert path.stat().st_size == after_bytes


def test_refuses_a_file_that_is_not_a_png_and_touches_nothing(tmp_path):
    good = tmp_path / "chart.png"
    _chart(good)
    size = good.stat().st_size
    text = tmp_path / "notes.txt"
    text.write_text("not a chart")
    result = subprocess.run([sys.executable, str(SCRIPT), str(good), str(text)], capture_output=True, text=True)
    assert result.returncode != 0
    assert "notes.txt" in result.stderr
    assert good.stat().st_size == size  # checked before any file is rewritten


def test_save_chart_writes_a_palette_png_of_the_same_picture(tmp_path):
    from hf_dflash2.charts import save_chart

    plain, palette = tmp_path / "plain.png", tmp_path / "palette.png"
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(["a", "b", "c"], [1.0, 2.5, 1.7], color=["#1f77b4", "#ff7f0e", "#2ca02c"])
    fig.savefig(plain, dpi=110)
    save_chart(fig, palette, dpi=110)
    plt.close(fig)
    with Image.open(plain) as a, Image.open(palette) as b:
        assert b.mode == "P"
        before, after = np.asarray(a.convert("RGB")).astype(int), np.asarray(b.convert("RGB")).astype(int)
    assert after.shape == before.shape
    assert (np.abs(after - before).sum(-1) == 0).mean() > 0.95
    assert palette.stat().st_size < plain.stat().st_size
    assert not list(tmp_path.glob(".*.partial"))


def test_save_chart_refuses_a_path_that_is_not_png(tmp_path):
    import pytest

    from hf_dflash2.charts import save_chart

    fig, _ = plt.subplots()
    with pytest.raises(ValueError, match="chart.jpg"):
        save_chart(fig, tmp_path / "chart.jpg")
    plt.close(fig)
    assert not list(tmp_path.iterdir())


def test_the_bench_chart_is_a_palette_png(tmp_path):
    from hf_dflash2.evaluation.bench import draw_chart

    report = {
        "settings": {"batch_size": 1, "temperature": 0.0},
        "datasets": {name: {"ar": {"tau": None, "speedup_vs_ar": 1.0}, "dflash2": {"tau": 3.1, "speedup_vs_ar": 1.9}}
                     for name in ("humaneval", "mtbench")},
    }
    draw_chart(report, tmp_path / "bench.png")
    with Image.open(tmp_path / "bench.png") as image:
        assert image.mode == "P"
        assert image.size[0] > 500
