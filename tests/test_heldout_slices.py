"""benchmarks/training/heldout_slices.py: held-out tau pooled over prompt slices; reports that disagree refused."""

from __future__ import annotations

import importlib.util
import json

import pytest

from .conftest import REPO


def _module():
    path = REPO / "benchmarks" / "training" / "heldout_slices.py"
    spec = importlib.util.spec_from_file_location("heldout_slices", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(path, slice_, cells):
    command = "python benchmarks/training/heldout_tau.py A B" + (f" --prompt-slice {slice_}" if slice_ else "")
    results = {
        head: {s: {"tau": c / r, "rounds": r, "committed": c} for s, (r, c) in zip(("humaneval", "mtbench"), pair)}
        for head, pair in cells.items()
    }
    path.write_text(json.dumps({"command": command, "results": results}))
    return path


def test_tau_is_pooled_over_rounds_and_compared_slice_by_slice(tmp_path):
    slices = _module()
    reports = [
        _report(tmp_path / "0.json", 0, {"A": ((100, 200), (50, 75)), "B": ((80, 200), (50, 100))}),
        _report(tmp_path / "1.json", 1, {"A": ((100, 300), (50, 100)), "B": ((150, 300), (40, 100))}),
        _report(tmp_path / "2.json", 2, {"A": ((10, 30), (10, 20))}),  # B not run here: not compared
    ]
    summary = slices.summarise(slices.collect(reports, None), "A")
    assert summary["A"]["humaneval"]["tau"] == round(530 / 210, 3)  # rounds-weighted, not the mean of 2.0, 3.0, 3.0
    assert summary["B"]["slices"] == [0, 1]
    b = summary["B"]["humaneval"]
    assert b["vs_baseline"] == round(((200 / 80 - 2.0) + (2.0 - 3.0)) / 2, 3)
    assert (b["slices_won"], b["slices_compared"]) == (1, 2)
    assert b["standard_error"] == round(abs((200 / 80 - 2.0) - (2.0 - 3.0)) / 2, 3)  # two points: |d1 - d2| / 2
    only_1 = slices.summarise(slices.collect(reports, slices.parse_slices("1-2")), "A")
    assert only_1["B"]["slices"] == [1] and only_1["A"]["humaneval"]["tau"] == round(330 / 110, 3)


def test_two_reports_that_disagree_on_a_head_and_slice_are_refused(tmp_path):
    slices = _module()
    reports = [
        _report(tmp_path / "a.json", 3, {"A": ((100, 200), (50, 75))}),
        _report(tmp_path / "b.json", 3, {"A": ((100, 200), (50, 75))}),  # the same run twice: fine
        _report(tmp_path / "c.json", 3, {"A": ((100, 201), (50, 75))}),
    ]
    assert slices.collect(reports[:2], None)["A"][3]["humaneval"]["committed"] == 200
    with pytest.raises(SystemExit, match=r"A on slice 3: .*c\.json says"):
        slices.collect(reports, None)
    for bad in ("one", "3-1", "1-", ""):
        with pytest.raises(SystemExit, match=f"--slices {bad!r}: expected"):
            slices.parse_slices(bad)
    assert slices.parse_slices("1-3, 7") == {1, 2, 3, 7}


def test_reports_of_one_slice_under_another_protocol_are_refused(tmp_path):
    slices = _module()
    plain = _report(tmp_path / "a.json", 2, {"A": ((100, 200), (50, 75))})
    longer = _report(tmp_path / "b.json", 2, {"B": ((100, 200), (50, 75))})
    longer.write_text(longer.read_text().replace("A B --prompt-slice 2", "A B --prompt-slice 2 --tokens 128"))
    with pytest.raises(SystemExit, match=r"slice 2: .*b\.json was measured with --tokens '128', .*a\.json with '64'"):
        slices.collect([plain, longer], None)
    narrower = _report(tmp_path / "c.json", 2, {"C": ((100, 200), (50, 75))})
    narrower.write_text(narrower.read_text().replace("A B --prompt-slice 2", "A B --prompt-slice 2 --block-size 8"))
    with pytest.raises(SystemExit, match=r"slice 2: .*c\.json was measured with --block-size '8'"):
        slices.collect([plain, narrower], None)  # a head measured at another block than its own
    one_slice = slices.summarise(slices.collect([plain], None) | {"B": slices.collect([plain], None)["A"]}, "A")
    assert one_slice["B"]["humaneval"]["standard_error"] is None  # not NaN, which JSON cannot hold


def test_heads_not_run_on_every_baseline_slice_are_left_out(tmp_path):
    slices = _module()
    reports = [
        _report(tmp_path / "0.json", 0, {"A": ((10, 20), (10, 20)), "B": ((10, 30), (10, 20))}),
        _report(tmp_path / "1.json", 1, {"A": ((10, 20), (10, 20)), "C": ((10, 30), (10, 20))}),
        _report(tmp_path / "2.json", 2, {"A": ((10, 20), (10, 20)), "B": ((10, 30), (10, 20)), "C": ((1, 3), (1, 2))}),
    ]
    table = slices.collect(reports, None)
    kept, left_out = slices.complete_heads(table, "A")
    assert set(kept) == {"A"} and left_out == {"B": [0, 2], "C": [1, 2]}
    kept, left_out = slices.complete_heads(slices.collect(reports, {0, 2}), "A")
    assert set(kept) == {"A", "B"} and left_out == {"C": [2]}
