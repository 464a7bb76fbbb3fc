"""The package's layers, read from the source with `ast`: no two modules import each other
(directly or round a longer loop), and an import only goes down, never up or sideways between
parts. Imports inside functions count the same: they may defer a slow or optional import (torch,
pyspark), never hide a cycle, and each says why in a comment on its line or the line above
(`# lazy: torch`). `if TYPE_CHECKING:` imports are left out (never run)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sparknet"

#: parts of the package, bottom first; a module imports only parts of a lower layer, or its own
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "say"),  # the ground floor: errors, progress lines, signals, clients
    ("interrupts", "imports", "spark_security", "processes", "environment"),
    # what runs on a node (the wheel's side of a command line): never the submitter's cluster/
    ("node",),
    ("aws",),
    ("data", "models"),
    ("config",),
    ("training", "cluster"),  # they meet in jobs and cli, never in each other
    ("api", "bench", "jobs"),
    ("ml",),  # Spark ML stages: the estimator fits through the API
    ("cli", "__init__"),  # `sparknet.fit`: the package's public face, above the API it names
)

#: `cluster/` inside, bottom first: what a cluster is and where its record is kept, reaching a
#: node, EC2, Spark on the nodes, then what runs a cluster's life (over both providers)
CLUSTER_LAYERS: tuple[tuple[str, ...], ...] = (
    ("address",),
    ("spec",),
    ("registry",),
    ("nodes",),
    ("node_endpoints", "sshkeys", "openssh", "known_hosts"),
    ("remote",),
    ("aws",),
    ("spark",),
    ("records",),
    ("inventory", "spark_nodes"),
    ("ami", "ec2_up", "markers"),
    ("ec2", "static"),  # the two providers, never importing each other
    ("provider",),
    ("repair",),
)


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(module: str, node: ast.Import | ast.ImportFrom, package: bool) -> Iterator[str]:
    """The dotted names an import statement may reach, most precise first for each name
    (`from a import b`: `a.b`, which is a module or else an attribute of `a`, then `a`)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        here = module.split(".") if package else module.split(".")[:-1]
        here = here[: len(here) - node.level + 1]
        base = ".".join([*here, base] if base else here)
    for alias in node.names:
        yield f"{base}.{alias.name}"


def _statements(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, but those under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (s for other in node.orelse for s in _statements(other))
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _statements(node)


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        targets = set()
        for node in _statements(ast.parse(path.read_text(), str(path))):
            for name in _imported(module, node, path.name == "__init__.py"):
                while name and name not in known:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _rank(name: str, layers: tuple[tuple[str, ...], ...]) -> int | None:
    return next((i for i, layer in enumerate(layers) if name in layer), None)


def place(module: str) -> tuple[str, int | None]:
    """(part, layer) of a module: its top-level part and that part's layer; inside `cluster/`,
    the cluster's own part and layer, as `cluster.<part>`."""
    parts = module.split(".")[1:] or ["__init__"]
    if parts[0] == "cluster" and len(parts) > 1:
        return f"cluster.{parts[1]}", _rank(parts[1], CLUSTER_LAYERS)
    return parts[0], _rank(parts[0], LAYERS)


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    """Imports that go up a layer or sideways between two parts of one layer."""
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if target == "sparknet.cluster" or module == "sparknet.cluster":
                continue  # the package's empty __init__
            (part, rank), (to_part, to_rank) = place(module), place(target)
            inside = part.startswith("cluster.") and to_part.startswith("cluster.")
            if not inside and (part.startswith("cluster.") or to_part.startswith("cluster.")):
                part, to_part = part.partition(".")[0], to_part.partition(".")[0]
                rank, to_rank = _rank(part, LAYERS), _rank(to_part, LAYERS)
            if part == to_part:
                continue
            if rank is None or to_rank is None or to_rank >= rank:
                found.append(f"{module} -> {target}")
    return found


#: a linter's or formatter's directive: a comment made only of these says nothing about why
_PRAGMA = re.compile(r"\s*(noqa\b|type:\s*ignore\b|fmt:|isort:|pragma:)", re.IGNORECASE)


def _function_imports(
    body: list[ast.stmt], inside: bool = False
) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of `body` inside a function, at any depth, but those under
    `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _function_imports(node.orelse, inside)
            continue
        if inside and isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        deeper = inside or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            yield from _function_imports(getattr(node, field, []), deeper)


def _comments(source: str) -> dict[int, tuple[str, bool]]:
    """line -> (its comment without directives, whether the line is nothing but the comment)."""
    found = {}
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            said = [p for p in token.string.split("#") if p.strip() and not _PRAGMA.match(p)]
            found[row] = (" ".join(p.strip() for p in said), not lines[row - 1][:col].strip())
    return found


def unexplained(source: str) -> list[tuple[int, str]]:
    """(line, statement) of each import inside a function with no reason beside it: a comment
    on one of its lines, or a comment line just above it."""
    comments = _comments(source)
    found = []
    for node in _function_imports(ast.parse(source).body):
        end = node.end_lineno or node.lineno
        beside = any(comments.get(n, ("", False))[0] for n in range(node.lineno, end + 1))
        said, alone = comments.get(node.lineno - 1, ("", False))
        if not beside and not (said and alone):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_every_part_has_a_layer():
    """A new part of the package is placed in `LAYERS` (or `CLUSTER_LAYERS`) before it lands."""
    unplaced = sorted({place(m)[0] for m in modules() if place(m)[1] is None} - {"cluster"})
    assert not unplaced, f"add these to a layer: {unplaced}"


def test_no_two_modules_import_each_other():
    assert cycles(import_graph()) == []


def test_imports_go_down_only():
    assert wrong_way(import_graph()) == []


def test_the_checks_catch_a_cycle_and_an_upward_import():
    """The checks on a made-up graph: they would see what they are meant to."""
    graph = {
        "sparknet.errors": {"sparknet.cli"},
        "sparknet.cli": {"sparknet.errors"},
        "sparknet.training.a": {"sparknet.cluster.spec"},
        "sparknet.cluster.spec": {"sparknet.cluster.nodes"},
        "sparknet.cluster.nodes": set(),
    }
    assert cycles(graph) == [["sparknet.cli", "sparknet.errors"]]
    assert wrong_way(graph) == [
        "sparknet.cluster.spec -> sparknet.cluster.nodes",
        "sparknet.errors -> sparknet.cli",
        "sparknet.training.a -> sparknet.cluster.spec",
    ]


def test_imports_inside_functions_say_why():
    """An import inside a function defers something slow or optional (torch, pyspark, boto3,
    ...) and says what, so a reader can tell it from one that hides a cycle or was never needed
    (`# lazy: torch`, with the module saying why once)."""
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {statement}"
        for path in sorted(modules().values())
        for line, statement in unexplained(path.read_text())
    ]
    assert not found, "an import inside a function with no comment saying why:\n" + "\n".join(found)


def test_the_check_catches_an_import_without_a_reason():
    """The check on made-up source: a bare import, a directive alone and a `#` inside a string
    are caught; a reason beside or above, and `if TYPE_CHECKING:` imports, pass."""
    source = """
from typing import TYPE_CHECKING

import os

if TYPE_CHECKING:
    import numpy


def bare():
    import torch

    return torch


def directive_only():
    import yaml  # noqa: F401


def in_a_string():
    import json; tag = "# lazy: json"


class Outer:
    def method(self):
        if os.environ:
            from pyspark import TaskContext

            return TaskContext


def told():
    import matplotlib  # lazy: matplotlib

    # lazy: pyspark, only on the executors
    from pyspark import TaskContext

    from sparknet.data import (  # lazy: boto3
        store,
    )
    import sparknet.training.worker  # lazy: torch  # noqa: F401

    if TYPE_CHECKING:
        import numpy
    return matplotlib, TaskContext, store
"""
    assert unexplained(source) == [
        (11, "import torch"),
        (17, "import yaml"),
        (21, "import json"),
        (27, "from pyspark import TaskContext"),
    ]
