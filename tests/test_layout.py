"""The layout's rules, read from the source with ``ast``: no import cycles among the project's modules, no
module importing another's private (``_name``) names, every stage package within what its ``__init__``
says it may import, and reading labels or replaying policies without Lightning."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from eagle_backbone.paths import REPO_ROOT

PACKAGES = ("eagle_backbone", "ldlp")

# module prefix -> prefixes it must never import (the rules the packages' __init__ docstrings state)
RULES = {
    "eagle_backbone": ("ldlp",),
    "ldlp.labels": ("ldlp.training", "ldlp.bench", "ldlp.report", "ldlp.pipeline", "lightning"),
    "ldlp.bench": ("ldlp.training", "ldlp.report", "ldlp.pipeline", "lightning"),
    "ldlp.training": ("ldlp.bench", "ldlp.report", "ldlp.pipeline"),
    "ldlp.report": ("ldlp.training", "ldlp.pipeline"),
}
# the method's top-level modules (all but the orchestrator): eagle_backbone and each other, never a stage package
RULES.update({f"ldlp.{f.stem}": ("ldlp.labels", "ldlp.training", "ldlp.bench", "ldlp.report", "ldlp.pipeline")
              for f in (REPO_ROOT / "ldlp").glob("*.py") if f.stem not in ("__init__", "pipeline")})


# -- the checker ---------------------------------------------------------------------------------------------


def project_modules(root: Path, packages) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``packages`` under ``root``."""
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def imports(name: str, path: Path, modules) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in the file, at any depth (imports
    inside functions count: they run too). ``from pkg import mod`` is an import of the module ``pkg.mod``."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, None, node.lineno) if sub in modules else (base, a.name, node.lineno))
    return out


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def check_layout(root: Path, packages, rules) -> dict[str, list[str]]:
    """Violations by kind: ``cycles``, ``private`` (another module's ``_name``) and ``rules`` (a forbidden
    import, ``rules`` mapping a module prefix to the prefixes it must not import)."""
    modules = project_modules(root, packages)
    graph: dict[str, set[str]] = {}
    found = {"cycles": [], "private": [], "rules": []}
    for name, path in modules.items():
        graph[name] = set()
        for target, attr, line in imports(name, path, modules):
            where = f"{path.relative_to(root)}:{line}"
            if target in modules and target != name and not within(name, target):  # a package's own __init__
                graph[name].add(target)
            if attr and attr.startswith("_") and not attr.startswith("__") and target in modules and target != name:
                found["private"].append(f"{where}: {name} imports {target}.{attr}")
            for prefix, banned in rules.items():
                if within(name, prefix):
                    found["rules"] += [f"{where}: {name} imports {target} ({prefix} never imports {b})"
                                       for b in banned if within(target, b)]
    # cycles: depth-first search, each cycle reported once (from its smallest module)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):]
                k = cycle.index(min(cycle))
                text = " -> ".join(cycle[k:] + cycle[:k] + [min(cycle)])
                if text not in found["cycles"]:
                    found["cycles"].append(text)
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


# -- the checker catches what it should --------------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_checker_finds_cycles_private_imports_and_rule_breaks(tmp_path):
    _write(tmp_path, {
        "core/__init__.py": "",
        "core/a.py": "from core import b\n",
        "core/b.py": "def f():\n    from .a import helper\n",  # a cycle through a function-level relative import
        "core/c.py": "from core.a import _private, public\n",
        "core/d.py": "import method.x\n",  # core never imports method
        "method/__init__.py": "",
        "method/x.py": "from core.c import thing\n",
    })
    found = check_layout(tmp_path, ("core", "method"), {"core": ("method",)})
    assert found["cycles"] == ["core.a -> core.b -> core.a"]
    assert [v.split(": ", 1)[1] for v in found["private"]] == ["core.c imports core.a._private"]
    assert len(found["rules"]) == 1 and "core.d imports method.x" in found["rules"][0]


def test_checker_passes_a_clean_package(tmp_path):
    _write(tmp_path, {
        "core/__init__.py": "from core.a import public\n",
        "core/a.py": "import json\n\npublic = 1\n\n\ndef _own():\n    return json\n",
        "core/b.py": "from . import a\nfrom core.a import public\n",
        "method/__init__.py": "",
        "method/x.py": "from core import b\nimport core.a\n",
    })
    assert check_layout(tmp_path, ("core", "method"), {"core": ("method",)}) == {"cycles": [], "private": [],
                                                                                "rules": []}


# -- the project ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layout():
    return check_layout(REPO_ROOT, PACKAGES, RULES)


def test_no_import_cycles(layout):
    assert layout["cycles"] == []


def test_no_private_imports_across_modules(layout):
    assert layout["private"] == []


def test_stage_packages_keep_their_import_rules(layout):
    assert layout["rules"] == []


def test_every_package_states_what_it_may_import():
    for init in sorted(p for pkg in PACKAGES for p in (REPO_ROOT / pkg).rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc, f"{init.relative_to(REPO_ROOT)}: the docstring does not say what it may import"


def test_reading_labels_and_replaying_policies_do_not_import_lightning():
    code = ("import sys, ldlp.labels.store, ldlp.bench.replay, ldlp.training.acceptance; "
            "assert 'lightning' not in sys.modules, sorted(m for m in sys.modules if 'lightning' in m)[:5]")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def test_no_engine_method_is_longer_than_60_lines():
    """The step reads as its phases (plan, draft, verify, accept, commit): no function of the engine module,
    the step and each phase included, runs over 60 lines."""
    tree = ast.parse((REPO_ROOT / "eagle_backbone" / "engine.py").read_text())
    long = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60}
    assert not long, f"engine functions over 60 lines: {long}"
