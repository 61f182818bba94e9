"""HumanEval-shaped training prompts from Python source (``hf-dflash2 regenerate --prompts python-functions``)."""

from __future__ import annotations

import textwrap

import pytest

DOCUMENTED = '''
import math
from os import path


def area(radius, *, scale=1.0):
    """Area of a circle of the given radius, multiplied by scale.

    Negative radii are rejected.
    """
    if radius < 0:
        raise ValueError(radius)
    value = math.pi * radius * radius
    return value * scale


def tiny(x):
    """Return x unchanged, whatever it is, without any work."""
    return x


def undocumented(x):
    y = x + 1
    y = y * 2
    y = y - 3
    return y


def _private(x):
    """A private helper that is long enough to count as documented."""
    y = x + 1
    y = y * 2
    return y
'''


def write_tree(root):
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "geometry.py").write_text(DOCUMENTED)
    (root / "pkg" / "tests").mkdir()
    (root / "pkg" / "tests" / "helpers.py").write_text(DOCUMENTED)  # tests are skipped
    (root / "pkg" / "broken.py").write_text("def broken(:\n")


def test_documented_public_functions_become_humaneval_shaped_prompts(tmp_path):
    from hf_dflash2.training.code_prompts import python_function_prompts

    write_tree(tmp_path)
    prompts, report = python_function_prompts([tmp_path])
    assert [p["id"] for p in prompts] == ["python/pkg.geometry.area"]
    content = prompts[0]["messages"][0]["content"]
    instruction = "Complete the following Python function.\n\n```python\n"  # as HumanEval is posed
    expected = instruction + "import math\nfrom os import path\n\n\n" + textwrap.dedent('''\
        def area(radius, *, scale=1.0):
            """Area of a circle of the given radius, multiplied by scale.

            Negative radii are rejected.
            """
        ```''')
    assert content == expected  # signature and docstring, never the body the target is asked to write
    assert "math.pi" not in content
    assert report.skipped == {"body too short": 1, "no docstring or a short one": 1, "unparseable file": 1}


def test_limit_seed_and_bad_roots(tmp_path):
    from hf_dflash2.training.code_prompts import python_function_prompts

    for name in "abcdef":
        (tmp_path / f"m_{name}.py").write_text(DOCUMENTED.replace("def area", f"def area_{name}"))
    first, _ = python_function_prompts([tmp_path], seed=1)
    again, _ = python_function_prompts([tmp_path], seed=1)
    other, _ = python_function_prompts([tmp_path], seed=2)
    assert first == again and len(first) == 6
    assert sorted(p["id"] for p in other) == sorted(p["id"] for p in first)
    assert len(python_function_prompts([tmp_path], limit=2)[0]) == 2
    with pytest.raises(FileNotFoundError, match="nowhere"):
        python_function_prompts([tmp_path / "nowhere"])
    with pytest.raises(ValueError, match="min_body_lines"):
        python_function_prompts([tmp_path], min_body_lines=0)


def test_regenerate_cli_names_a_missing_source_before_loading(tmp_path, monkeypatch):
    import hf_dflash2.assets
    from hf_dflash2.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(hf_dflash2.assets, "load_target", no_load)
    missing = tmp_path / "missing"
    with pytest.raises(SystemExit, match="missing"):
        main(["regenerate", "--prompts", f"python-functions:{missing}", "--output", str(tmp_path / "out.jsonl")])
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("skip", [-1, 3])
def test_regenerate_cli_refuses_a_skip_past_the_prompts_before_loading(tmp_path, monkeypatch, skip):
    import hf_dflash2.assets
    from hf_dflash2.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(hf_dflash2.assets, "load_target", no_load)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "question {i}"}}\n' for i in range(3)))
    with pytest.raises(SystemExit, match=f"--skip {skip}"):
        main(["regenerate", "--prompts", str(prompts), "--skip", str(skip), "--output", str(tmp_path / "out.jsonl")])
    assert not (tmp_path / "out.jsonl").exists()


def test_evaluation_problems_never_become_training_prompts(tmp_path):
    """A source file that holds a HumanEval problem verbatim is dropped like any other training source."""
    from hf_dflash2.assets import load_humaneval_prompts
    from hf_dflash2.training.code_prompts import python_function_prompts
    from hf_dflash2.training.commands import _load_prompts

    problem = load_humaneval_prompts()[0]["messages"][0]["content"].split("```python\n", 1)[1].rsplit("```", 1)[0]
    body = "    result = []\n    for item in numbers:\n        result.append(item)\n    return bool(result)\n"
    (tmp_path / "leak.py").write_text(problem + body)
    (tmp_path / "geometry.py").write_text(DOCUMENTED)
    assert len(python_function_prompts([tmp_path])[0]) == 2  # the leak is a valid prompt on its own
    prompts = _load_prompts(f"python-functions:{tmp_path}", seed=0)
    assert [p["id"] for p in prompts] == ["python/geometry.area"]


def test_regenerate_cli_refuses_an_unknown_linear_kernel_before_loading(tmp_path, monkeypatch):
    import hf_dflash2.assets
    from hf_dflash2.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(hf_dflash2.assets, "load_target", no_load)
    with pytest.raises(SystemExit, match="'mkl'"):
        main(["regenerate", "--linear-kernel", "mkl", "--output", str(tmp_path / "out.jsonl")])
    assert not (tmp_path / "out.jsonl").exists()


def test_regenerate_cli_probes_the_linear_kernel_at_its_batch_size(tmp_path, monkeypatch):
    """Regeneration multiplies one row per running prompt, so `auto` is timed at --batch-size rows, not at
    decoding's 1 and 16; the kernel is set before the first forward."""
    import hf_dflash2.assets
    import hf_dflash2.cpu.linear_kernels
    import hf_dflash2.training.regenerate
    from hf_dflash2.cli import main

    from .conftest import tiny_target
    from .test_conventions import tiny_base_tokenizer

    target = tiny_target(vocab_size=96)
    calls = []
    monkeypatch.setattr(hf_dflash2.assets, "load_target", lambda *a, dtype=None: (target, tiny_base_tokenizer()))
    monkeypatch.setattr(hf_dflash2.cpu.linear_kernels, "use_linear_kernel",
                        lambda model, kernel, rows: calls.append((model, kernel, rows)) or "default")
    monkeypatch.setattr(hf_dflash2.training.regenerate, "regenerate",
                        lambda model, *args, **kwargs: calls.append(("regenerate", model)))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello world"}\n')
    main(["regenerate", "--prompts", str(prompts), "--batch-size", "48", "--output", str(tmp_path / "out.jsonl"),
          "--mixed-precision", "fp32"])
    assert calls == [(target, "auto", (48,)), ("regenerate", target)]
