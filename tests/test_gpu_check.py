"""scripts/gpu_check.py on the CPU with tiny settings, so that the accelerator check cannot rot."""

from __future__ import annotations

import importlib.util
import json

import pytest

from .conftest import REPO


@pytest.fixture(autouse=True)
def _cost_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DFLASH2_CACHE", str(tmp_path / "cache"))


def test_gpu_check_runs_on_cpu_tiny(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    output = tmp_path / "gpu_check.json"
    code = module.main(["--device", "cpu", "--dtype", "fp32", "--tiny", "--output", str(output)])
    report = json.loads(output.read_text())
    assert code == 0 and report["ok"], report
    assert all(report["greedy_identity"]["checks"].values()) and len(report["greedy_identity"]["checks"]) == 7
    assert report["sampling_law"]["total_variation"] < report["sampling_law"]["bound"]
    speeds = report["speed"]
    for key in ("b1_ar_tok_s", "b1_fast_adaptive_tok_s", "b1_generate_assistant_tok_s", "b8_fast_fixed_tok_s"):
        assert speeds[key] > 0
    assert report["compiled_draft"]["ok"] and report["compiled_draft"]["compiled_ms"] > 0


def test_gpu_check_refuses_a_missing_device():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit, match="CUDA is not available"):
        module.main(["--device", "cuda"])
