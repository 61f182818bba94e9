"""The examples run as a user runs them (the real model, offline), so that they cannot rot."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import REPO


@pytest.mark.slow
def test_quickstart_runs_and_its_checks_hold():
    result = subprocess.run([sys.executable, str(REPO / "examples" / "quickstart.py"), "--max-new-tokens", "32"],
                            capture_output=True, text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "identical to plain generate: True" in result.stdout
    assert "the same text both times: True" in result.stdout
    assert result.stdout.count("--- row") == 2
    assert "log-probabilities equal generate's: True" in result.stdout
