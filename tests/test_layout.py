"""The layout's rules, read from the source with ``ast``: no import cycles among the project's modules nor
among its packages, no module importing another's private (``_name``) names, every stage package within what
its ``__init__`` says it may import, no plots or Markdown in the decoding core nor in ldlp outside ldlp.report,
reading labels or replaying policies without Lightning, and no test module importing another."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eagle_backbone.paths import REPO_ROOT

PACKAGES = ("eagle_backbone", "ldlp")

# module prefix -> prefixes it must never import (the rules the packages' __init__ docstrings state): the data
# flow labels -> training -> models -> policies -> bench -> report, with the pipeline above them all
STAGES = ("ldlp.labels", "ldlp.training", "ldlp.models", "ldlp.policies", "ldlp.bench", "ldlp.report", "ldlp.pipeline")
RULES = {
    "eagle_backbone": ("ldlp",),
    "ldlp.models": tuple(s for s in STAGES if s != "ldlp.models") + ("lightning",),
    "ldlp.labels": ("ldlp.training", "ldlp.policies", "ldlp.bench", "ldlp.report", "ldlp.pipeline", "lightning"),
    "ldlp.training": ("ldlp.policies", "ldlp.bench", "ldlp.report", "ldlp.pipeline"),
    "ldlp.policies": ("ldlp.labels", "ldlp.training", "ldlp.bench", "ldlp.report", "ldlp.pipeline", "lightning"),
    "ldlp.bench": ("ldlp.training", "ldlp.report", "ldlp.pipeline", "lightning"),
    "ldlp.report": ("ldlp.training", "ldlp.pipeline"),
}

# ldlp.bench's sub-packages, by the kind of experiment -> the sub-packages each never imports (on top of what
# ldlp.bench never imports): the harness under everything, comparisons and engine measurements on the harness alone,
# the peers on the harness and the comparisons (the vLLM peer is a contender of the load sweep and of serving)
BENCH_KINDS = {
    "ldlp.bench.harness": ("ldlp.bench.comparisons", "ldlp.bench.peers", "ldlp.bench.measurements"),
    "ldlp.bench.comparisons": ("ldlp.bench.peers", "ldlp.bench.measurements"),
    "ldlp.bench.peers": ("ldlp.bench.measurements",),
    "ldlp.bench.measurements": ("ldlp.bench.comparisons", "ldlp.bench.peers"),
}
RULES |= {kind: RULES["ldlp.bench"] + banned for kind, banned in BENCH_KINDS.items()}

# modules above every package (orchestrators nothing in the packages imports): a node of their own in the
# package graph, so that the orchestrator importing the stages it runs is not a cycle of its package with them
ENTRY_POINTS = ("ldlp.pipeline",)
CORE = "eagle_backbone"


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
    found["cycles"] = _cycles(graph)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every cycle a depth-first search meets, each reported once (rotated to start at its smallest node)."""
    found: list[str] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):]
                k = cycle.index(min(cycle))
                text = " -> ".join(cycle[k:] + cycle[:k] + [min(cycle)])
                if text not in found:
                    found.append(text)
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def package_of(name: str, path: Path, entry_points=()) -> str:
    """The package a module belongs to: itself for a package's ``__init__`` or an entry point, else its parent."""
    if path.name == "__init__.py" or name in entry_points:
        return name
    return name.rsplit(".", 1)[0]


def package_cycles(root: Path, packages, entry_points=()) -> list[str]:
    """Cycles among packages: package A depends on package B when a module of A imports a module of B (a
    subpackage is a package of its own; ``entry_points`` are nodes of their own). Two packages that import
    each other, through any modules, are a cycle even when no two modules are."""
    modules = project_modules(root, packages)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        a = package_of(name, path, entry_points)
        graph.setdefault(a, set())
        for target, _, _ in imports(name, path, modules):
            if target in modules:
                b = package_of(target, modules[target], entry_points)
                if b != a:
                    graph[a].add(b)
    return _cycles(graph)


def imported_by(root: Path, packages, module: str) -> list[str]:
    """The project's modules that import ``module``."""
    modules = project_modules(root, packages)
    return sorted(n for n, p in modules.items() if n != module and any(t == module for t, _, _ in imports(n, p, modules)))


MARKDOWN_FILE = re.compile(r"\.md\b")
DOCS_LINK = re.compile(r"docs/[\w./#-]*\.md\b")  # an error message pointing at the docs names no page it writes


def plots_and_markdown(root: Path, package: str, allow: re.Pattern | None = None) -> list[str]:
    """Where a package's modules plot or write Markdown: an import of matplotlib (at any depth), a function
    whose name says Markdown, or a string (docstrings aside) naming a ``.md`` file (``allow``: references
    left out)."""
    found = []
    for name, path in project_modules(root, (package,)).items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        where = path.relative_to(root)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [f"{where}:{node.lineno}: imports {a.name}" for a in node.names if within(a.name, "matplotlib")]
            elif isinstance(node, ast.ImportFrom) and node.module and within(node.module, "matplotlib"):
                found.append(f"{where}:{node.lineno}: imports {node.module}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "markdown" in node.name.lower():
                found.append(f"{where}:{node.lineno}: defines {node.name}")
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                  and MARKDOWN_FILE.search(allow.sub("", node.value) if allow else node.value)):
                found.append(f"{where}:{node.lineno}: names a Markdown file ({node.value[:40]!r})")
    return found


NAMES = re.compile(r"``([\w.]+)``|\b(labels|training|models|policies|bench|report|pipeline|Lightning)\b")


def import_statement(doc: str, package: str) -> tuple[set[str], set[str]]:
    """The modules a package's docstring says it may import and those it says it never imports, from its
    ``May import ...; never ...`` sentence: names in double backquotes, and the stage names, "Lightning" and
    "the pipeline" written bare (``ldlp`` under "never" in a stage package: every other stage)."""
    m = re.search(r"May import (.*?)(?:\.\s|\.?$)", " ".join(doc.split()))  # to the end of its sentence
    if not m:
        return set(), set()
    may, _, never = m.group(1).partition("never")

    def names(part: str, banned: bool) -> set[str]:
        out = set()
        for quoted, bare in NAMES.findall(part):
            name = (quoted or bare).lower()
            name = f"ldlp.{name}" if f"ldlp.{name}" in STAGES else name  # a stage by its short name
            if name == "ldlp" and banned and within(package, "ldlp"):
                out |= {s for s in STAGES if s != package}
            else:
                out.add(name)
        return out

    return names(may, False), names(never, True)


def cross_test_imports(tests: Path) -> list[str]:
    """Where a module under ``tests`` imports a test module (``test_*.py`` there), at any depth: shared helpers
    live in ``conftest.py`` or a helper module, so that no test module runs another's module-level code or
    depends on its layout."""
    own = {f.stem for f in tests.glob("test_*.py")}
    found = []
    for f in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"), str(f))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{f.name}:{node.lineno}: imports {n}" for n in names if n.split(".")[0] in own]
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


def test_package_checker_finds_a_cycle_between_packages_without_a_module_cycle(tmp_path):
    _write(tmp_path, {
        "core/__init__.py": "",
        "core/engine.py": "from core.sub import model\n",  # core -> core.sub
        "core/errors.py": "",
        "core/sub/__init__.py": "",
        "core/sub/model.py": "",
        "core/sub/bench.py": "from core import engine, errors\n",  # core.sub -> core: no module cycle
        "method/__init__.py": "",
        "method/rules.py": "import core.engine\n",
        "method/stage/__init__.py": "",
        "method/stage/run.py": "from method import rules\n",  # method.stage -> method
        "method/main.py": "from method.stage import run\n",  # method -> method.stage, unless main is an entry point
    })
    assert check_layout(tmp_path, ("core", "method"), {})["cycles"] == []
    assert package_cycles(tmp_path, ("core", "method")) == ["core -> core.sub -> core",
                                                            "method -> method.stage -> method"]
    assert package_cycles(tmp_path, ("core", "method"), entry_points=("method.main",)) == ["core -> core.sub -> core"]
    assert imported_by(tmp_path, ("core", "method"), "core.engine") == ["core.sub.bench", "method.rules"]


def test_test_import_checker(tmp_path):
    _write(tmp_path, {
        "conftest.py": "import json\n",
        "helpers.py": "from conftest import json\n",
        "test_a.py": "from helpers import json\nfrom conftest import json\n",
        "test_b.py": "import test_a\n\n\ndef test_x():\n    from test_a import json\n",
        "test_c.py": "from test_b import test_x  # noqa\n",
        "helpers_bad.py": "import test_c.sub\n",
    })
    assert cross_test_imports(tmp_path) == ["helpers_bad.py:1: imports test_c.sub", "test_b.py:1: imports test_a",
                                             "test_b.py:5: imports test_a", "test_c.py:1: imports test_b"]


def test_plot_and_markdown_checker(tmp_path):
    _write(tmp_path, {
        "core/__init__.py": '"""Writes no README.md (a docstring may name one)."""\n',
        "core/a.py": "def plot():\n    import matplotlib.pyplot as plt\n",
        "core/b.py": "from matplotlib import ticker\n",
        "core/c.py": "def table_markdown(rows):\n    return ''\n",
        "core/d.py": "def write(out):\n    (out / 'page.md').write_text('x')\n",
        "core/e.py": "import json\n\n\ndef f():\n    return json.dumps({'amd': 1, 'x.mdl': 2})\n",
    })
    found = plots_and_markdown(tmp_path, "core")
    assert [f.split(": ", 1)[0] for f in found] == ["core/a.py:2", "core/b.py:1", "core/c.py:1", "core/d.py:2"]


# -- the project ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layout():
    return check_layout(REPO_ROOT, PACKAGES, RULES)


def test_no_import_cycles(layout):
    assert layout["cycles"] == []


def test_no_package_level_cycles():
    """No two packages depend on each other (eagle_backbone and its subpackages, ldlp and its stages), the
    orchestrator (``ENTRY_POINTS``) standing above them all."""
    assert package_cycles(REPO_ROOT, PACKAGES, ENTRY_POINTS) == []


def test_entry_points_are_imported_by_no_package_module():
    """Nothing in the packages imports an entry point or any of its modules (``ldlp.pipeline.plan`` is the
    pipeline's), except the entry point's own modules."""
    modules = project_modules(REPO_ROOT, PACKAGES)
    for m in ENTRY_POINTS:
        users = sorted(n for n, p in modules.items() if not within(n, m)
                       and any(within(t, m) for t, _, _ in imports(n, p, modules)))
        assert users == [], f"{m} is an entry point: nothing in the packages imports it"


def test_decoding_core_neither_plots_nor_writes_markdown():
    """Benchmarks live in ldlp.bench, pages and plots in ldlp.report; no module under eagle_backbone/ imports
    matplotlib, defines a Markdown renderer or names a ``.md`` file."""
    assert plots_and_markdown(REPO_ROOT, CORE) == []


def test_report_renders_every_page_the_stages_return_rows():
    """ldlp.report renders every page and plot. The stages below it (labels, training, models, policies, bench)
    return rows and write their JSON, and whoever runs them (a script in scripts/, or the pipeline) writes the page
    with ldlp.report: no module of ldlp outside ldlp/report plots, defines a Markdown renderer or names a page file
    (an error may point at docs/*.md). The pipeline, above them all, may name the pages it waits for or publishes
    into (a stage's product, the README), never render one."""
    found = plots_and_markdown(REPO_ROOT, "ldlp", allow=DOCS_LINK)
    outside = [f for f in found if not f.startswith("ldlp/report/")
               and not (f.startswith("ldlp/pipeline/") and ": names a Markdown file" in f)]
    assert outside == []


def test_bench_is_sub_packages_by_kind_of_experiment():
    """Every module of ldlp.bench lives in a sub-package named for its kind of experiment (``BENCH_KINDS``: the
    harness every experiment shares, comparisons, peers, engine measurements), none beside them; each sub-package's
    ``__init__`` says what it holds and states the import rule ``RULES`` checks for it."""
    bench = REPO_ROOT / "ldlp" / "bench"
    assert sorted(f.name for f in bench.glob("*.py")) == ["__init__.py"], "a module of ldlp.bench outside a sub-package"
    kinds = sorted(f"ldlp.bench.{d.name}" for d in bench.iterdir() if (d / "__init__.py").is_file())
    assert kinds == sorted(BENCH_KINDS)
    for kind in kinds:
        init = bench / kind.rsplit(".", 1)[1] / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        assert doc.split("May import")[0].strip(), f"{init.relative_to(REPO_ROOT)}: no docstring saying what it holds"
        assert kind in RULES


def test_no_test_module_imports_another():
    """Test modules share helpers and fixtures through ``tests/conftest.py`` and helper modules
    (``tests/oracle_helpers.py``), never by importing one another."""
    assert cross_test_imports(REPO_ROOT / "tests") == []


def test_no_private_imports_across_modules(layout):
    assert layout["private"] == []


def test_stage_packages_keep_their_import_rules(layout):
    assert layout["rules"] == []


def test_every_package_states_the_rules_this_file_checks():
    """Each package in ``RULES`` says in its ``__init__`` what it may import and what never, and says what
    ``RULES`` checks: a project package it may import is not banned, one it never imports is, and every project
    package it does not list as allowed is banned (third-party names, Lightning among them, are checked in the
    first two ways only: the lists need not name every library)."""
    project = (CORE,) + STAGES
    for pkg, banned in RULES.items():
        init = REPO_ROOT / pkg.replace(".", "/") / "__init__.py"
        may, never = import_statement(ast.get_docstring(ast.parse(init.read_text())) or "", pkg)
        where = f"{init.relative_to(REPO_ROOT)}"
        assert may or never, f"{where}: the docstring has no 'May import ...; never ...' statement"
        is_banned = lambda m: any(within(m, b) or within(b, m) for b in banned)  # noqa: E731
        assert not [m for m in may if is_banned(m)], f"{where}: may import {may}, but RULES[{pkg!r}] bans {banned}"
        assert all(is_banned(n) for n in never), f"{where}: never imports {never}, but RULES[{pkg!r}] bans {banned}"
        allowed = {p for p in project for m in may if within(m, p) or within(p, m)}
        unlisted = [p for p in project if p not in allowed and not within(pkg, p) and not is_banned(p)]
        assert not unlisted, f"{where}: does not list {unlisted} as allowed, and RULES[{pkg!r}] does not ban them"


def test_import_statement_parser():
    doc = ("Things.\n\nMay import ``eagle_backbone``, torch and ``ldlp.models``; never Lightning, ``training``, bench\n"
           "or the pipeline.")
    assert import_statement(doc, "ldlp.policies") == (
        {"eagle_backbone", "ldlp.models"}, {"lightning", "ldlp.training", "ldlp.bench", "ldlp.pipeline"})
    other = "May import ``eagle_backbone`` only; never another ``ldlp`` package (they import this one)."
    assert import_statement(other, "ldlp.models") == ({"eagle_backbone"}, set(STAGES) - {"ldlp.models"})
    assert import_statement("May import torch; never ``ldlp``.", CORE) == (set(), {"ldlp"})
    assert import_statement("Imports what it needs.", "ldlp.bench") == (set(), set())


def test_reading_labels_and_replaying_policies_do_not_import_lightning():
    code = ("import sys, ldlp.labels.store, ldlp.bench.harness.replay, ldlp.training.acceptance; "
            "assert 'lightning' not in sys.modules, sorted(m for m in sys.modules if 'lightning' in m)[:5]")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


ENGINE_MODULES = ("engine", "batched_engine", "step_records", "prefill", "tree_step", "decoder")


def test_no_engine_method_is_longer_than_60_lines():
    """The step reads as its phases (plan, draft, verify, accept, commit): no function of the engine's modules,
    the step and each phase included, runs over 60 lines."""
    long = {}
    for name in ENGINE_MODULES:
        tree = ast.parse((REPO_ROOT / "eagle_backbone" / f"{name}.py").read_text())
        long |= {f"{name}.{n.name}": n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60}
    assert not long, f"engine functions over 60 lines: {long}"


def test_engine_module_keeps_its_public_names():
    """``from eagle_backbone.engine import ...`` (code written when the engine was one module) still gives the
    engine, the batch-1 front doors and the output record, the same objects as their modules'."""
    from eagle_backbone import batched_engine, decoder, engine, step_records

    assert sorted(engine.__all__) == ["BatchedSpeculativeEngine", "GenerationOutput", "SpeculativeDecoder",
                                      "autoregressive_generate"]
    assert engine.BatchedSpeculativeEngine is batched_engine.BatchedSpeculativeEngine
    assert engine.SpeculativeDecoder is decoder.SpeculativeDecoder
    assert engine.autoregressive_generate is decoder.autoregressive_generate
    assert engine.GenerationOutput is step_records.GenerationOutput



def test_no_module_outgrows_its_package_limit():
    """A file that outgrows its room is split at its seams (eagle_backbone: the engine's step records, prefill, tree
    phases, clocks and front doors each have a module): at most 600 lines in eagle_backbone/, 500 in ldlp/."""
    limits = {"eagle_backbone": 600, "ldlp": 500}
    over = [f"{f.relative_to(REPO_ROOT)}: {n} lines (limit {limits[pkg]})" for pkg in limits
            for f in sorted((REPO_ROOT / pkg).rglob("*.py"))
            if (n := len(f.read_text(encoding="utf-8").splitlines())) > limits[pkg]]
    assert not over, over


# where a drafter kind's name may still be compared outside its own file, and why (neither is what a kind does)
KIND_NAMES_ALLOWED = {
    "ldlp/report/summary.py": "pages list EAGLE-1's rows first",
    "scripts/bench_retired_loop.py": "the retired batch-1 loop's own generators, read from git at an old commit",
}


def kind_branches(root: Path, dirs, names) -> list[str]:
    """Where code under ``dirs`` (eagle_backbone/kinds/ aside) compares something whose name says ``kind`` with a
    drafter kind's name (``kind == "eagle3"``, ``eng.kind in ("eagle", "eagle3")``)."""
    found = []
    for d in dirs:
        for f in sorted((root / d).rglob("*.py")):
            rel = f.relative_to(root)
            if rel.parts[:2] == ("eagle_backbone", "kinds"):
                continue
            for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"), str(f))):
                if not isinstance(node, ast.Compare):
                    continue
                sides = [node.left, *node.comparators]
                named = any("kind" in n.id.lower() if isinstance(n, ast.Name) else
                            "kind" in n.attr.lower() if isinstance(n, ast.Attribute) else
                            isinstance(n, ast.Constant) and n.value in ("kind", "drafter_kind")
                            for s in sides for n in ast.walk(s))
                if named and any(isinstance(n, ast.Constant) and n.value in names for s in sides for n in ast.walk(s)):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_a_drafter_kind_lives_in_one_file_and_is_looked_up_by_name():
    """Each shipped drafter kind is one module of eagle_backbone/kinds/ (its loading, drafting, profiling hooks and
    labels); everything else asks the registry (eagle_backbone/drafter_kinds.py) instead of comparing its name."""
    from eagle_backbone.drafter_kinds import get_kind, kind_names

    shipped = [n for n in kind_names() if get_kind(n).__module__.startswith("eagle_backbone.kinds.")]
    assert {"eagle", "eagle3", "draft_lm"} <= set(shipped)
    modules = [get_kind(n).__module__ for n in shipped]
    assert len(set(modules)) == len(modules), modules  # one kind a file
    files = sorted(f.stem for f in (REPO_ROOT / "eagle_backbone" / "kinds").glob("*.py") if f.stem != "__init__")
    assert sorted(m.rsplit(".", 1)[1] for m in modules) == files  # and every file there a kind
    found = [f for f in kind_branches(REPO_ROOT, ("eagle_backbone", "ldlp", "scripts"), set(shipped))
             if f.split(":")[0] not in KIND_NAMES_ALLOWED]
    assert not found, found


def test_the_kind_check_catches_a_branch_on_a_kind_name(tmp_path):
    _write(tmp_path, {"pkg/a.py": "def f(kind, eng, row):\n    x = kind == 'eagle3'\n    y = eng.kind in ('eagle',)\n"
                                  "    z = row.get('drafter_kind') != 'eagle'\n    return layout == 'eagle'\n"})
    assert [f.split(": ")[0] for f in kind_branches(tmp_path, ("pkg",), {"eagle", "eagle3"})] == \
        ["pkg/a.py:2", "pkg/a.py:3", "pkg/a.py:4"]


# ---- the policy protocol ---------------------------------------------------------------------------------------

# the protocol's calls: the core, the lifecycle, two optional step hooks; a TreePolicy adds the tree hooks only
POLICY_CORE = {"plan", "observe", "stop"}
POLICY_LIFECYCLE = {"bind", "begin", "report"}
POLICY_STEP_HOOKS = {"reads", "timed"}
TREE_HOOKS = {"select", "tree_now", "tree_width", "verified"}


def _public_methods(cls) -> set[str]:
    return {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}


def test_the_policy_protocol_is_its_core_and_lifecycle_and_trees_are_apart():
    """``DraftPolicy`` declares ``plan``/``observe``/``stop``, the lifecycle and two optional step hooks, and
    capabilities as flags; the tree hooks live on ``TreePolicy`` alone; the per-sequence protocol is gone."""
    import eagle_backbone.policy as protocol

    assert _public_methods(protocol.DraftPolicy) == POLICY_CORE | POLICY_LIFECYCLE | POLICY_STEP_HOOKS
    assert _public_methods(protocol.TreePolicy) == TREE_HOOKS
    for gone in ("DraftLengthPolicy", "PerSlot", "OneRow", "DraftContext"):
        assert not hasattr(protocol, gone), gone


def test_every_shipped_policy_binds_to_a_view_and_keeps_tree_hooks_on_trees():
    """Each policy of ldlp/policies takes an ``EngineView`` at ``bind`` (never the engine: no policy reads the
    engine's attributes) and defines tree hooks only as a ``TreePolicy``."""
    import importlib
    import inspect

    from eagle_backbone.policy import DraftPolicy, TreePolicy

    found = []
    for f in sorted((REPO_ROOT / "ldlp" / "policies").glob("*.py")):
        module = importlib.import_module(f"ldlp.policies.{f.stem}")
        for name, cls in vars(module).items():
            if not (inspect.isclass(cls) and issubclass(cls, DraftPolicy) and cls.__module__ == module.__name__):
                continue
            if list(inspect.signature(cls.bind).parameters) != ["self", "view"]:
                found.append(f"{f.stem}.{name}.bind{inspect.signature(cls.bind)}")
            if not issubclass(cls, TreePolicy) and _public_methods(cls) & TREE_HOOKS:
                found.append(f"{f.stem}.{name}: tree hooks on a chain policy")
        tree = ast.parse(f.read_text(encoding="utf-8"))
        found += [f"{f.stem}:{n.lineno}: engine.{n.attr}" for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "engine"]
    assert found == [], found
