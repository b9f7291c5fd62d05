"""The embedded conversation corpus, built from text every Python installation carries.

Conversations are in ShareGPT layout (``{"id", "conversations": [{"from", "value"}]}``) and come
from three sources of the running interpreter's standard library:

* docstrings: "What does ``json.dumps`` do?" -> the docstring (prose, hard to predict);
* source: "Show me the source of ``textwrap.dedent``." -> the code (boilerplate, easy to predict);
* the language reference topics shipped in ``pydoc_data.topics`` (long English prose).

Mixing prose and code is deliberate: adaptive draft length pays off exactly where predictable and
unpredictable stretches alternate. Modules are parsed with :mod:`ast` and never imported, so
building the corpus has no side effects. Splits are assigned *by module* (and by topic for the
reference prose) from a stable hash, so test conversations come from modules never seen in training.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

from eagle_backbone.io import atomic_write_json, atomic_write_text

SPLITS = ("train", "validation", "test")
# Packages whose text is mostly tests, generated tables or GUI glue: little signal, lots of bytes.
_SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "site-packages",
               "dist-packages", "ensurepip", "venv", "__pycache__", "pydoc_data", "encodings"}
_MAX_SOURCE_CHARS = 2400
_MIN_DOC_CHARS = 40


@dataclass(frozen=True)
class CorpusConfig:
    seed: int = 0
    validation_percent: int = 5
    test_percent: int = 5
    max_source_chars: int = _MAX_SOURCE_CHARS
    max_modules: int | None = None  # keep only the first N modules (by name): small corpora for tests


def split_of(name: str, cfg: CorpusConfig = CorpusConfig()) -> str:
    """Stable split for a module (or topic) name: independent of PYTHONHASHSEED and of file order."""
    bucket = int(hashlib.sha256(f"{cfg.seed}:{name}".encode()).hexdigest(), 16) % 100
    if bucket < cfg.test_percent:
        return "test"
    if bucket < cfg.test_percent + cfg.validation_percent:
        return "validation"
    return "train"


def stdlib_modules() -> list[tuple[str, Path]]:
    """(dotted module name, file) for the pure-Python standard library, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in _SKIP_PARTS or part.startswith("test_") for part in rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts or any(not p.isidentifier() for p in parts):
            continue
        out.append((".".join(parts), path))
    return sorted(out)


def _definitions(tree: ast.Module):
    """Top-level functions and classes, plus methods of top-level classes, with qualified names."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name.startswith("_"):
                continue
            yield node.name, node
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not sub.name.startswith("_"):
                        yield f"{node.name}.{sub.name}", sub


def _turn(frm: str, value: str) -> dict:
    return {"from": frm, "value": value}


def module_conversations(module: str, source: str, rng: random.Random, cfg: CorpusConfig) -> list[dict]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    convs = []
    mod_doc = ast.get_docstring(tree)
    if mod_doc and len(mod_doc) >= _MIN_DOC_CHARS:
        q = rng.choice(["What is the `{m}` module for?", "Explain the `{m}` module.",
                        "What does the Python module `{m}` provide?"]).format(m=module)
        convs.append([_turn("human", q), _turn("gpt", mod_doc.strip())])
    lines = source.splitlines(keepends=True)
    for qual, node in _definitions(tree):
        name = f"{module}.{qual}"
        doc = ast.get_docstring(node)
        # Slicing whole lines (not ast.get_source_segment, which re-splits the file per call) keeps
        # the build linear in the file size; dedent makes methods read like top-level code.
        code = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno])).rstrip()
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        has_doc = bool(doc) and len(doc) >= _MIN_DOC_CHARS
        has_code = bool(code) and len(code) <= cfg.max_source_chars
        if not (has_doc or has_code):
            continue
        ask_doc = rng.choice(["What does `{n}` do?", "Explain the {k} `{n}`.",
                              "Describe `{n}` in Python's standard library."]).format(n=name, k=kind)
        ask_code = rng.choice(["Show me the source of `{n}`.", "How is `{n}` implemented?",
                               "Write the {k} `{n}` as the standard library does."]).format(n=name, k=kind)
        code_answer = f"```python\n{code}\n```" if has_code else ""
        if has_doc and has_code and rng.random() < 0.5:
            convs.append([_turn("human", ask_doc), _turn("gpt", doc.strip()),
                          _turn("human", rng.choice(["Show me its implementation.", "And the code?",
                                                     "How is it written?"])),
                          _turn("gpt", code_answer)])
        else:
            if has_doc:
                convs.append([_turn("human", ask_doc), _turn("gpt", doc.strip())])
            if has_code:
                convs.append([_turn("human", ask_code), _turn("gpt", code_answer)])
    return convs


def topic_conversations(rng: random.Random) -> list[tuple[str, list[dict]]]:
    """Language-reference prose, one conversation per topic (long topics cut at paragraph breaks)."""
    from pydoc_data.topics import topics

    out = []
    for topic in sorted(topics):
        paragraphs = [p.strip() for p in topics[topic].split("\n\n") if p.strip()]
        chunk: list[str] = []
        for part, para in enumerate(paragraphs + [None]):
            if para is not None and sum(map(len, chunk)) + len(para) < 2000:
                chunk.append(para)
                continue
            if chunk:
                q = rng.choice(["Explain `{t}` in the Python language reference.",
                                "What does the language reference say about `{t}`?",
                                "Tell me about `{t}` in Python."]).format(t=topic)
                out.append((topic, [_turn("human", q), _turn("gpt", "\n\n".join(chunk))]))
            chunk = [para] if para is not None else []
    return out


def build_corpus(cfg: CorpusConfig = CorpusConfig()) -> dict[str, list[dict]]:
    """All conversations, keyed by split. Deterministic for a given Python version and seed."""
    splits: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for module, path in stdlib_modules()[: cfg.max_modules]:
        rng = random.Random(f"{cfg.seed}:{module}")
        source = path.read_text(encoding="utf-8", errors="replace")
        for i, conv in enumerate(module_conversations(module, source, rng, cfg)):
            splits[split_of(module, cfg)].append({"id": f"{module}#{i}", "module": module, "conversations": conv})
    rng = random.Random(f"{cfg.seed}:topics")
    for i, (topic, conv) in enumerate(topic_conversations(rng)):
        splits[split_of("topic:" + topic, cfg)].append(
            {"id": f"topic:{topic}#{i}", "module": "topic:" + topic, "conversations": conv})
    return splits


def corpus_hash(splits: dict[str, list[dict]]) -> str:
    h = hashlib.sha256()
    for split in SPLITS:
        h.update(json.dumps(splits[split], sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()


def write_corpus(out_dir: str | os.PathLike, cfg: CorpusConfig = CorpusConfig()) -> dict:
    """Write ``{split}.json`` (ShareGPT layout) and ``manifest.json``; returns the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = build_corpus(cfg)
    for split, convs in splits.items():
        atomic_write_text(out / f"{split}.json", json.dumps(convs, ensure_ascii=False))
    manifest = {
        "python_version": sys.version.split()[0],
        "seed": cfg.seed,
        "sha256": corpus_hash(splits),
        "counts": {s: len(c) for s, c in splits.items()},
        "chars": {s: sum(len(t["value"]) for c in v for t in c["conversations"]) for s, v in splits.items()},
    }
    atomic_write_json(out / "manifest.json", manifest, newline=False)
    return manifest
