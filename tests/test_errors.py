"""fp8ray raises its own exception classes (fp8ray/errors.py), never a bare builtin one.

Each class derives from the builtin a caller would catch (``ValueError``, ``RuntimeError``),
so ``except ValueError`` keeps working while ``except BadInputError`` is precise; a bare
``raise ValueError(...)`` is the one a caller cannot tell apart. ``TypeError`` for an
argument of the wrong type stays the builtin (errors.py says why).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fp8ray"
BARE = {"ValueError", "RuntimeError", "Exception"}


def bare_raises(source: str) -> list[tuple[int, str]]:
    """``(line, class name)`` of each ``raise`` of a bare builtin class in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(raised, ast.Name) and raised.id in BARE:
                found.append((node.lineno, raised.id))
    return sorted(found)


def test_the_check_finds_bare_raises_in_every_form():
    source = (
        "def f(x):\n"
        "    if x:\n"
        "        raise ValueError('no')\n"
        "    try:\n"
        "        pass\n"
        "    except KeyError:\n"
        "        raise RuntimeError from None\n"
        "    raise Exception(\n        'many lines'\n    )\n"
        "def g():\n"
        "    raise BadInputError('fine')\n"
        "def h(exc):\n"
        "    raise exc\n"
    )
    assert bare_raises(source) == [(3, "ValueError"), (7, "RuntimeError"), (8, "Exception")]


def test_fp8ray_raises_its_own_classes():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        offenders += [f"fp8ray/{name}:{line}: raise {cls}" for line, cls in bare_raises(path.read_text())]
    assert not offenders, "raise one of fp8ray.errors' classes instead:\n" + "\n".join(offenders)
