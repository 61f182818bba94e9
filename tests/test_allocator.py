"""The trainer's allocator setting: freed memory stays mapped, so a step's temporaries stop faulting."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

from hf_dflash2.cpu.allocator import retain_freed_memory

ROUNDS = textwrap.dedent("""
    import sys, torch
    from hf_dflash2.cpu.allocator import minor_page_faults, retain_freed_memory

    print(retain_freed_memory() if sys.argv[1] == "retain" else "default")
    for _ in range(4):
        before = minor_page_faults()
        temporaries = [torch.ones(6 << 20 >> 2) for _ in range(8)]  # 8 x 6 MiB, every page written
        del temporaries
        print(minor_page_faults() - before)
""")
PAGES = 8 * (6 << 20) // 4096


def fault_rounds(setting: str) -> tuple[str, list[int]]:
    out = subprocess.run([sys.executable, "-c", ROUNDS, setting], capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0], [int(n) for n in out[1:]]


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc on Linux")
def test_freed_temporaries_are_reused_without_faulting_in_fresh_pages():
    # The premise: with glibc's defaults, rounds after the first fault their pages in again (12,285 of 12,288
    # in the second round here).
    _, default = fault_rounds("default")
    assert default[0] > PAGES // 2 and default[1] > PAGES // 2, default
    taken, retained = fault_rounds("retain")
    assert taken == "True"
    assert retained[0] > PAGES // 2 and max(retained[1:]) < PAGES // 4, retained


def test_elsewhere_nothing_happens_and_a_value_mallopt_cannot_take_is_named(monkeypatch):
    with pytest.raises(ValueError, match="got 2147483648 and 0"):
        retain_freed_memory(trim_threshold=2**31, top_pad=0)
    monkeypatch.setattr(sys, "platform", "win32")
    assert retain_freed_memory() is False
