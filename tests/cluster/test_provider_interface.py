"""The provider interface, read from the source and the modules: nothing outside `cluster/` asks
which provider a cluster has (no `is_static`, no `.provider == "static"`), and `aws` (ec2.py)
and `static` (static.py) each implement every constant and function of `provider.Provider`
with its parameters."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from sparknet.cluster import ec2, provider, static
from sparknet.cluster.spec import ClusterSpec

PACKAGE = Path(__file__).resolve().parents[2] / "sparknet"
#: the providers' names: a comparison with one of them asks which provider it is
NAMES = frozenset(provider.PROVIDERS)


def _names_provider(node: ast.expr) -> bool:
    """`x.provider`, or `x.get("provider")`: what a spec or a settings entry says."""
    if isinstance(node, ast.Attribute):
        return node.attr == "provider"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        args = [a.value for a in node.args if isinstance(a, ast.Constant)]
        return node.func.attr == "get" and args[:1] == ["provider"]
    return False


def provider_checks(source: str) -> list[int]:
    """The lines of `source` that ask which provider a cluster has: `is_static` named, or a
    provider compared with a provider's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        name = getattr(node, "id", None) or getattr(node, "attr", None)
        if isinstance(node, ast.Name | ast.Attribute) and name == "is_static":
            found.append(node.lineno)
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(s, ast.Constant) and s.value in NAMES for s in sides)
            if named and any(_names_provider(s) for s in sides):
                found.append(node.lineno)
    return sorted(set(found))


def test_nothing_outside_cluster_asks_which_provider_it_has():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if "cluster" not in path.relative_to(PACKAGE).parts[:1]
        for line in provider_checks(path.read_text())
    ]
    assert not found, "ask provider.of(spec) instead:\n" + "\n".join(found)


def test_the_check_catches_the_ways_to_ask():
    source = """
if spec.provider == "static": pass
if "aws" != known.provider: pass
if entry.get("provider") != "static": pass
if provider.is_static(spec): pass
if is_static(spec): pass
if base.get("provider", "aws") != known.provider: pass
if provider.of(spec).REGIONAL: pass
"""
    assert provider_checks(source) == [2, 3, 4, 5, 6]


def _parameters(function) -> list[tuple[str, inspect._ParameterKind]]:
    """(name, kind) of each parameter of an interface method, `self` left out."""
    found = inspect.signature(function).parameters.values()
    return [(p.name, p.kind) for p in found if p.name != "self"]


def test_both_providers_implement_the_whole_interface():
    """Each constant is a bool; each function takes the interface's parameters, in its order
    and kind (an implementation may add its own, with defaults, after them)."""
    members = {n: v for n, v in vars(provider.Provider).items() if not n.startswith("_")}
    constants = provider.Provider.__annotations__
    assert {"REGIONAL", "AUTOSTOP", "LAUNCHES"} <= set(constants)
    for module in (ec2, static):
        for name in constants:
            assert isinstance(getattr(module, name), bool), f"{module.__name__}.{name}"
        for name, member in members.items():
            if not callable(member):
                continue
            want = _parameters(member)
            have = inspect.signature(getattr(module, name)).parameters
            got = [(p.name, p.kind) for p in have.values()][: len(want)]
            assert got == want, f"{module.__name__}.{name}"
            extra = list(have.values())[len(want) :]
            assert all(p.default is not inspect.Parameter.empty for p in extra), name


def test_the_provider_is_chosen_from_the_spec():
    assert provider.of(ClusterSpec(name="c1")) is ec2
    static_spec = ClusterSpec(
        name="c1", provider="static", hosts=["10.0.0.5"], key_file="/keys/id_ed25519"
    )
    assert provider.of(static_spec) is static
    assert provider.named(None) is ec2 and provider.named("static") is static
    assert (ec2.REGIONAL, ec2.AUTOSTOP, ec2.LAUNCHES) == (True, True, True)
    assert (static.REGIONAL, static.AUTOSTOP, static.LAUNCHES) == (False, False, False)
