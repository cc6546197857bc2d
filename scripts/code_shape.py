#!/usr/bin/env python3
"""The shape of fp8ray's code, for before/after notes of a refactor: the longest
functions, the widest signatures, bare builtin raises and long lines.

    .venv/bin/python scripts/code_shape.py [PACKAGE_DIR]      # default: fp8ray/
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

BUILTIN_RAISES = {"ValueError", "RuntimeError", "Exception"}


def main(root: Path) -> None:
    functions, raises, long_lines = [], 0, 0
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        long_lines += sum(len(line) > 130 for line in text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = (
                    len(a.posonlyargs)
                    + len(a.args)
                    + len(a.kwonlyargs)
                    - (1 if a.args and a.args[0].arg in ("self", "cls") else 0)
                )
                functions.append(
                    (node.end_lineno - node.lineno + 1, params, f"{path.relative_to(root.parent)}:{node.lineno} {node.name}")
                )
            if (
                isinstance(node, ast.Raise)
                and isinstance(node.exc, ast.Call)
                and getattr(node.exc.func, "id", None) in BUILTIN_RAISES
            ):
                raises += 1
    print("longest functions (lines):")
    for lines, _, name in sorted(functions, reverse=True)[:8]:
        print(f"  {lines:4d}  {name}")
    print("widest signatures (parameters, self not counted):")
    for _, params, name in sorted(functions, key=lambda f: (-f[1], f[2]))[:8]:
        print(f"  {params:4d}  {name}")
    print(
        f"functions: {len(functions)}; raise ValueError/RuntimeError/Exception: {raises}; lines over 130 characters: {long_lines}"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "fp8ray"))
