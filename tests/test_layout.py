"""The source layout's rules: the remote-code set a saved head carries is flat and complete, and the
package's modules import one another without a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, tiny_drafter, tiny_target

PACKAGE = REPO / "src" / "hf_dflash2"
REMOTE_CODE = sorted(PACKAGE.glob("*_dflash2.py"))  # the remote-code set: flat siblings in the package root


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _sibling_imports(path: Path) -> set[str]:
    """The remote-code siblings a file imports anywhere in it (module level or inside functions)."""
    return {node.module for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
            and node.level == 1 and node.module}


def test_remote_code_imports_only_its_siblings():
    """A saved head carries the ``*_dflash2.py`` files and nothing else of the package, and loads with
    ``trust_remote_code`` where hf_dflash2 is not installed: each file imports the others as
    ``from .sibling import X`` and nothing of hf_dflash2 another way."""
    siblings = {path.stem for path in REMOTE_CODE}
    assert {"configuration_dflash2", "modeling_dflash2", "custom_generate_dflash2"} <= siblings
    problems = []
    for path in REMOTE_CODE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                if node.level != 1 or node.module not in siblings:
                    problems.append(f"{path.name}:{node.lineno}: from {'.' * node.level}{node.module or ''} import ...")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hf_dflash2":
                problems.append(f"{path.name}:{node.lineno}: from {node.module} import ...")
            elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "hf_dflash2" for a in node.names):
                problems.append(f"{path.name}:{node.lineno}: import {', '.join(a.name for a in node.names)}")
    assert not problems, "remote code reaching outside its set:\n" + "\n".join(problems)


def test_a_saved_head_carries_every_file_its_modeling_code_needs(tmp_path):
    """``save_pretrained`` writes the modeling file and, transitively, every sibling it imports: that closure
    is the whole remote-code set, so a saved head is complete and carries no file it does not need."""
    by_name = {path.stem: path for path in REMOTE_CODE}
    needed, frontier = set(), ["modeling_dflash2"]
    while frontier:
        name = frontier.pop()
        if name not in needed:
            needed.add(name)
            frontier.extend(_sibling_imports(by_name[name]) - needed)
    needed.add("configuration_dflash2")  # auto_map's AutoConfig (the modeling file imports it too)
    assert needed == set(by_name), f"remote-code files the modeling file never reaches: {set(by_name) - needed}"

    tiny_drafter(tiny_target()).save_pretrained(tmp_path / "head")
    written = {path.stem for path in (tmp_path / "head").glob("*_dflash2.py")}
    assert written == needed
    for name in written:  # copies of this checkout's files
        assert (tmp_path / "head" / f"{name}.py").read_bytes() == by_name[name].read_bytes(), name


def _module_level_imports(module: str, path: Path) -> set[str]:
    """The hf_dflash2 modules ``module`` imports while it is imported: statements at module level (and in
    class bodies, ``if`` / ``try`` / ``with`` blocks), not inside functions and not under ``TYPE_CHECKING``.
    ``from package import name`` counts the submodule when ``name`` is one, else the package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()

    def resolve(node: ast.ImportFrom) -> str | None:
        if node.level == 0:
            return node.module
        base = package.split(".")
        base = base[: len(base) - (node.level - 1)]
        return ".".join([*base, node.module] if node.module else base)

    def visit(statements):
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = resolve(node)
                for alias in node.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, None) or [])

    visit(ast.parse(path.read_text()).body)
    return {name for name in found if name in MODULES and name != module}


def test_the_package_imports_without_a_cycle():
    """No two modules of hf_dflash2 import each other, directly or around a loop, at import time."""
    graph = {module: _module_level_imports(module, path) for module, path in MODULES.items()}
    assert graph["hf_dflash2.generation.loop"] >= {"hf_dflash2.generation.trees", "hf_dflash2.speculative_dflash2"}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == 1:
                return path[path.index(imported):] + [imported]
            if imported not in state and (cycle := walk(imported)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := walk(module)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_the_generation_package_keeps_its_public_names():
    """``hf_dflash2.generation`` is the public API's home: what users, the trainer and the benchmarks import."""
    import hf_dflash2
    from hf_dflash2 import generation

    for name in ("speculative_generate", "SpeculativeOutput", "PLAIN_GREEDY", "resolve_generation_config",
                 "apply_repetition_penalty", "prefill", "verify", *generation.__all__):
        assert hasattr(generation, name), name
    for name in hf_dflash2.__all__:
        assert hasattr(hf_dflash2, name), name


@pytest.mark.slow
def test_every_module_imports_on_its_own():
    """Each module imported first, in a fresh interpreter: an import cycle that a static reading misses
    (or an import that works only after another module) fails here."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    def first_import(module: str) -> str | None:
        result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                                timeout=300)
        return None if result.returncode == 0 else f"{module}: {result.stderr.strip().splitlines()[-1]}"

    modules = [module for module in sorted(MODULES) if not module.endswith("__main__")]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        failures = [failure for failure in pool.map(first_import, modules) if failure]
    assert not failures, "\n".join(failures)
