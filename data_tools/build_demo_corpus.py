#!/usr/bin/env python3
"""A JSONL corpus from text shipped with Python itself, so the demo needs no download.

    python3 data_tools/build_demo_corpus.py --out demo/corpus.jsonl

Documents: every topic of the reference manual in ``pydoc_data.topics`` and the docstrings of the
standard library (modules, classes, functions), read with ``ast`` from the source files: nothing is
imported or run. The files are walked in sorted order, so the corpus is the same on every run of
the same Python. Each line is ``{"text": ..., "source": ...}``; the file is written under a
temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import os
import sys
import sysconfig

SKIP_DIRS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "turtledemo",
    "lib2to3",
    "ensurepip",
    "venv",
}


def pydoc_topics():
    """``(source, text)`` for each reference-manual topic."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield f"pydoc_data:{name}", topics[name].strip()


def _module_name(root: str, path: str) -> str:
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _docstrings(tree: ast.Module, module: str):
    doc = ast.get_docstring(tree)
    if doc:
        yield module, f"Module {module}\n\n{doc}"
    stack = [(node, module) for node in tree.body]
    while stack:
        node, scope = stack.pop(0)
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            qual = f"{scope}.{node.name}"
            doc = ast.get_docstring(node)
            if doc:
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                yield qual, f"{kind} {qual}\n\n{doc}"
            if isinstance(node, ast.ClassDef):
                stack[0:0] = [(child, qual) for child in node.body]


def stdlib_docstrings(root: str | None = None):
    """``(source, text)`` for each docstring in the standard library's ``.py`` files."""
    root = root or sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(f for f in filenames if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            try:
                with open(path, "rb") as f:
                    tree = ast.parse(f.read(), path)
            except (SyntaxError, ValueError, OSError):
                continue  # a few stdlib files are deliberately unparsable or unreadable
            yield from _docstrings(tree, _module_name(root, path))


def build(out: str, min_chars: int = 80, max_docs: int | None = None) -> tuple[int, int]:
    """Write the corpus to ``out``; return (documents, characters)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    docs = chars = 0
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for source, text in itertools.chain(pydoc_topics(), stdlib_docstrings()):
                if len(text) < min_chars:
                    continue
                f.write(json.dumps({"text": text, "source": source}, ensure_ascii=False) + "\n")
                docs, chars = docs + 1, chars + len(text)
                if max_docs and docs >= max_docs:
                    break
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return docs, chars


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output .jsonl path")
    p.add_argument("--min-chars", type=int, default=80, help="drop shorter documents")
    p.add_argument("--max-docs", type=int, default=None)
    args = p.parse_args(argv)
    docs, chars = build(args.out, args.min_chars, args.max_docs)
    print(f"wrote {args.out}: {docs:,} documents, {chars / 1e6:.1f} M characters", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
