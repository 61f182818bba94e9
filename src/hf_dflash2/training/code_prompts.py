"""Code-completion prompts from Python source on this machine (the standard library by default).

Regenerated ShareGPT responses hold little code, and a head trained on them drafts HumanEval's function
completions worst. The standard library is public, always installed and offline, and its documented
functions give prompts in the same shape as HumanEval's (imports, signature, docstring) without touching
HumanEval: ``drop_evaluation_prompts`` still runs on them, as on every training source. By default the
installed packages' source (``purelib``: numpy, sympy, torch, transformers, ...) is read too, so the set
depends on what is installed; every prompt's id names its module.

    hf-dflash2 regenerate --prompts python-functions --output data/regen_code.jsonl
"""

from __future__ import annotations

import ast
import logging
import random
import sysconfig
from pathlib import Path

from ..assets import LoadReport, function_completion_request

logger = logging.getLogger(__name__)

# Tests, demos and vendored grammars document little and read unlike code people ask a model to finish.
SKIPPED_PARTS = {"test", "tests", "idle_test", "lib2to3", "site-packages", "dist-packages", "__pycache__", "turtledemo"}


def default_source_folders() -> list[Path]:
    """The standard library and the installed packages of the running interpreter."""
    paths = sysconfig.get_paths()
    return [Path(paths["stdlib"]), Path(paths["purelib"])]


def _imports(tree: ast.Module, lines: list[str], limit: int = 4) -> list[str]:
    """The module's first few top-level one-line imports (what the function's names may come from)."""
    found = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno == node.end_lineno:
            found.append(lines[node.lineno - 1].strip())
            if len(found) == limit:
                break
    return found


def function_prompt(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str], imports: list[str]) -> str | None:
    """Imports, signature and docstring of ``node`` (whose first statement is its docstring) as the code of a
    HumanEval-style prompt, or None when it is tab-indented."""
    head = "\n".join(lines[node.lineno - 1 : node.body[0].end_lineno])
    if "\t" in head:
        return None
    return ("\n".join(imports) + "\n\n\n" if imports else "") + head + "\n"


def python_function_prompts(
    roots: list[str | Path] | None = None,
    limit: int | None = None,
    seed: int = 0,
    min_docstring_chars: int = 40,
    min_body_lines: int = 3,
    max_prompt_chars: int = 2000,
) -> tuple[list[dict], LoadReport]:
    """Public top-level functions with a docstring and a body of at least ``min_body_lines`` lines after it,
    as chat prompts ``{"id", "messages"}`` asking for the completed function (shuffled with ``seed``)."""
    if min_body_lines < 1 or min_docstring_chars < 0 or max_prompt_chars < 1:
        raise ValueError(
            f"min_body_lines ({min_body_lines}) and max_prompt_chars ({max_prompt_chars}) must be >= 1 and "
            f"min_docstring_chars ({min_docstring_chars}) >= 0"
        )
    folders = [Path(r) for r in roots] if roots else default_source_folders()
    for folder in folders:
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: not a folder of Python source")
    report, prompts, seen, ids = LoadReport(), [], set(), set()
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            if SKIPPED_PARTS & set(path.relative_to(folder).parts[:-1]) or path.name.startswith("test_"):
                continue
            try:
                source = path.read_text(encoding="utf-8")
                tree = ast.parse(source)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                report.skip("unparseable file")
                continue
            lines = source.splitlines()
            imports = _imports(tree, lines)
            for node in tree.body:
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                    continue
                docstring = ast.get_docstring(node) or ""
                if len(docstring) < min_docstring_chars:
                    report.skip("no docstring or a short one")
                    continue
                if node.end_lineno - node.body[0].end_lineno < min_body_lines:
                    report.skip("body too short")
                    continue
                text = function_prompt(node, lines, imports)
                if text is None or len(text) > max_prompt_chars:
                    report.skip("prompt too long or tab-indented")
                    continue
                key = (node.name, docstring)
                if key in seen:
                    report.skip("duplicate")
                    continue
                seen.add(key)
                module = ".".join(path.relative_to(folder).with_suffix("").parts)
                prompt_id = f"python/{module}.{node.name}"
                if prompt_id in ids:  # the same module path under two roots
                    prompt_id = f"{prompt_id}#{len(ids)}"
                ids.add(prompt_id)
                content = function_completion_request(text)
                prompts.append({"id": prompt_id, "messages": [{"role": "user", "content": content}]})
                report.loaded += 1
    random.Random(seed).shuffle(prompts)
    if limit is not None:
        prompts = prompts[:limit]
    logger.info("Python functions: %s", report)
    return prompts, report
