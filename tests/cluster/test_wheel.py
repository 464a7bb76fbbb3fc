"""The wheel the nodes get: it declares exactly the distributions sparknet imports, and with only
those installed every module imports; an installed sparknet can make a cluster (the wheel carries
infra/, the Terraform module and the shared rule and policy files, as package data, read from the
install with the repository nowhere on the path); and a node whose installed sparknet does not
start fails its bootstrap step."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import invoke
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from sparknet.cluster.address import Endpoint
from sparknet.cluster.spark import bootstrap as b
from sparknet.cluster.spark.plan import Context, Facts, Node, Plan
from sparknet.cluster.spark.steps import PythonEnv, SparknetWheel
from sparknet.cluster.spark.wheel import Wheel, build_wheel

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

#: what the install must read back: rules and policies through rules.py, the module's files,
#: and the node's scripts
CHECK = """
import sys
from pathlib import Path
import sparknet
from sparknet.cluster.aws import rules
from sparknet.cluster.spec import INFRA_DIR
here = Path(sparknet.__file__).resolve()
assert here.is_relative_to(Path(sys.argv[1]).resolve()), here
assert INFRA_DIR.resolve().is_relative_to(Path(sys.argv[1]).resolve()), INFRA_DIR
ingress = [r["from_port"] for r in rules.security_group_rules("ingress")]
policy = rules.policy_document("instance-role", partition="aws", region="us-east-1",
    account="123456789012", bucket="b-data", data_prefix="datasets/", runs_prefix="runs/",
    cluster="demo")
print(ingress, rules.network()["az_count"], rules.bucket_settings()["versioning"],
      len(policy["Statement"]), sorted(p.name for p in INFRA_DIR.glob("*.tf")))
from sparknet.node import files
print("scripts", *(len(files.script(n)) > 0 for n in ("marker.sh", "apt_install.sh",
      "torch_fits.py")))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Wheel:
    """The wheel the nodes get (`build_wheel`: from a copy of the repo's sources, no build/ or
    egg-info in the checkout)."""
    return build_wheel(REPO, tmp_path_factory.mktemp("wheel") / "dist")


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed with --target into an empty directory."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(target), str(wheel.path)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return target


def wheel_metadata(wheel: Wheel) -> list[tuple[str, str]]:
    """The (header, value) pairs of the wheel's METADATA."""
    with zipfile.ZipFile(wheel.path) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return list(HeaderParser().parsestr(zf.read(name).decode()).items())


def declared(wheel: Wheel) -> list[Requirement]:
    """The wheel's own dependencies: Requires-Dist without an extra."""
    reqs = [Requirement(v) for k, v in wheel_metadata(wheel) if k == "Requires-Dist"]
    return [r for r in reqs if not (r.marker and "extra" in str(r.marker))]


def imported_top_names() -> tuple[set[str], set[str]]:
    """The top-level names sparknet's modules import, outside the standard library and sparknet:
    at module level, and only inside functions (the lazy imports of optional parts)."""
    eager, lazy = set(), set()
    for path in (REPO / "sparknet").rglob("*.py"):
        tree = ast.parse(path.read_text())
        inner = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
            for n in ast.walk(f)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "sparknet":
                    (lazy if id(node) in inner else eager).add(top)
    return eager, lazy - eager


#: distributions sparknet declares without importing them by name: what it imports needs them
#: at run time without declaring them itself
USED_THROUGH = {
    "pandas": "pyspark's DataFrame-to-pandas paths (`toPandas`, pandas UDFs) need it",
}


def test_the_wheel_declares_exactly_the_distributions_sparknet_imports(wheel) -> None:
    dists = importlib.metadata.packages_distributions()
    eager, lazy = imported_top_names()
    needs = {canonicalize_name(dists[top][0]) for top in eager}
    main = {canonicalize_name(r.name) for r in declared(wheel)}
    extras = {
        canonicalize_name(Requirement(v).name)
        for k, v in wheel_metadata(wheel)
        if k == "Requires-Dist" and "extra" in v
    }
    assert needs - main == set(), "imported at module level, not declared"
    lazy_needs = {canonicalize_name(dists[top][0]) for top in lazy}
    assert main - needs - lazy_needs == set(USED_THROUGH), "declared, not imported"
    # a name several distributions provide (`mlflow`: mlflow, mlflow-skinny, mlflow-tracing)
    # is declared where any of them is
    undeclared = {
        top for top in lazy if not {canonicalize_name(d) for d in dists[top]} & (main | extras)
    }
    assert undeclared == set(), "imported lazily, declared nowhere"
    assert "click" in needs  # cli/common.py's: typer no longer brings it


def pip_sources() -> list[str]:
    """The package sources pip is configured with, as uv flags: what `make install` gives uv
    (the Makefile turns `pip config list` into them), so the venv installs from this machine's
    mirror and nothing else."""
    done = subprocess.run(
        ["make", "-n", "-B", "install"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    [line] = [x for x in done.stdout.splitlines() if "/uv pip install" in x]
    return line.split("--compile-bytecode ")[1].split(" --python ")[0].split()


#: what the fresh venv takes from the test's own env rather than installing: torch's CUDA wheels
#: are gigabytes (minutes to unpack on every run)
GIVEN = ("torch", "torchvision", "pyspark")


def closure(names: tuple[str, ...]) -> list[importlib.metadata.Distribution]:
    """The installed distributions `names` need, theirs included (markers for this Python)."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen[name] = importlib.metadata.distribution(name)
        for text in seen[name].requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def given_site(root: Path) -> Path:
    """A directory of links to GIVEN and what they need (their files in the test's env), and
    nothing else: the fresh venv sees it through a .pth file."""
    site = root / "given"
    site.mkdir()
    for dist in closure(GIVEN):
        base = Path(str(dist.locate_file("")))
        tops = {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}
        for top in tops:
            if not (site / top).exists() and (base / top).exists():
                (site / top).symlink_to(base / top)
    return site


#: imports every module of the installed sparknet (a __main__ runs its command: not imported);
#: prints each failure as one line
IMPORT_ALL = """
import importlib, pkgutil, sys, sparknet
assert sparknet.__file__.startswith(sys.prefix), sparknet.__file__
failed = 0
for mod in pkgutil.walk_packages(sparknet.__path__, "sparknet."):
    if mod.name.endswith(".__main__"):
        continue
    try:
        importlib.import_module(mod.name)
    except Exception as exc:
        failed += 1
        print(f"{mod.name}: {type(exc).__name__}: {exc}")
sys.exit(1 if failed else 0)
"""


def test_with_only_its_declared_dependencies_every_module_imports(wheel, tmp_path) -> None:
    """A fresh venv (no system site packages, no dev extras) with the wheel and what it
    declares, from this machine's package mirror; torch, torchvision and pyspark and what they
    need come from the test's env through a .pth (GIVEN), nothing else does."""
    given = given_site(tmp_path)
    assert not any((given / name).exists() for name in ("click", "typer", "boto3"))
    venv = tmp_path / "venv"
    uv = [str(Path(sys.executable).parent / "uv")]
    subprocess.run(
        [*uv, "venv", "-q", "--python", sys.executable, str(venv)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "_given.pth").write_text(f"{given}\n")
    install = [*uv, "pip", "install", "-q", *pip_sources(), "--python", str(python)]
    rest = [str(r) for r in declared(wheel) if canonicalize_name(r.name) not in GIVEN]
    for args in (["--no-deps", str(wheel.path)], rest):
        done = subprocess.run([*install, *args], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run(
        [str(python), "-c", IMPORT_ALL],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    cli = [str(venv / "bin" / "sparknet"), "--help"]
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_node_whose_sparknet_does_not_start_fails_its_step(wheel, tmp_path, monkeypatch) -> None:
    """The node's venv (laid over the repo's .venv, as the loopback nodes' are) gets the wheel;
    a module of its that cannot import (`click` shadowed by one that raises, as on a node
    where a dependency is missing) fails the sparknet step in one line naming the error, and
    its check never says done."""
    node = Node(Endpoint("master", "127.0.0.1"), prefix=str(tmp_path / "prefix"))
    plan = Plan((node,), wheel, "s", python_env=str(REPO / ".venv"))
    facts = Facts(os.environ.get("USER") or "root", os.getuid(), 1, 1 << 22, False, ())
    ctx = Context(plan, node, facts)
    monkeypatch.chdir(tmp_path)  # not the checkout: `python -c` would import its sparknet
    conn = invoke.Context()
    (tmp_path / "prefix" / "dist").mkdir(parents=True)
    b.run_steps("master", [PythonEnv(ctx)], conn)
    site = subprocess.run(
        [node.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "click.py").write_text("raise ModuleNotFoundError(\"No module named 'click'\")\n")
    step = SparknetWheel(ctx)
    with pytest.raises(b.StepFailed) as caught:
        b.run_steps("master", [step], conn)
    assert re.fullmatch(
        r"master: step sparknet failed \(the installed sparknet does not start \(`sparknet "
        r"--help` exited 1\)\): ModuleNotFoundError: No module named 'click'",
        str(caught.value),
    ), str(caught.value)
    assert not step.check(conn)
    (Path(site) / "click.py").unlink()
    assert b.run_steps("master", [step], conn).applied == ("sparknet",)
    assert step.check(conn)


def test_wheel_carries_infra_files_as_package_data(installed) -> None:
    infra = installed / "sparknet" / "cluster" / "infra"
    assert not infra.is_symlink() and infra.is_dir()
    have = {p.relative_to(infra).as_posix() for p in infra.rglob("*") if p.is_file()}
    want = {
        p.relative_to(REPO / "infra").as_posix()
        for p in (REPO / "infra").rglob("*")
        if p.is_file() and ".terraform/" not in p.as_posix() and not p.name.endswith("tfstate")
    }
    assert have == want


def test_an_installed_sparknet_reads_the_rules_without_the_repo(installed, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(installed)
    result = subprocess.run(
        [sys.executable, "-c", CHECK, str(installed)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("[", 2)[1].startswith("22, 0]"), result.stdout
    assert "3 Enabled 5" in result.stdout and "'versions.tf'" in result.stdout
    assert "scripts True True True" in result.stdout  # what runs before the wheel: its files


def test_the_package_links_infra_rather_than_copying_it() -> None:
    """One copy: sparknet/cluster/infra in the checkout is a link to infra/."""
    link = REPO / "sparknet" / "cluster" / "infra"
    assert link.is_symlink() and link.resolve() == (REPO / "infra").resolve()
