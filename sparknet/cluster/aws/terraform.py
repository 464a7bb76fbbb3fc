"""Runs the Terraform foundation (infra/) through python-terraform.

Init, apply, output, destroy, with each cluster's state in its own directory and failures as
one-line `SparknetError`s.

Where state lives: the module declares ``backend "local" {}`` and `init` sets its ``path`` to
``<state_dir>/terraform.tfstate`` with ``-backend-config``; ``TF_DATA_DIR`` points at
``<state_dir>/.terraform``, so each cluster keeps its own backend settings and modules and two
clusters never share a state. Provider plugins are shared through ``TF_PLUGIN_CACHE_DIR``
(default ``~/.cache/sparknet/terraform-plugins``), so a second cluster does not download the AWS
provider again. A user's own backend: put ``terraform { backend "s3" {} }`` in
``infra/backend_override.tf`` and pass its settings as ``backend_config``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from python_terraform import IsFlagged, Terraform

from sparknet.environment import variables
from sparknet.errors import SparknetError

#: the oldest Terraform the modules are written for (`required_version` in infra/): 1.9 is the
#: first whose variable validations may name another variable (runs_prefix's against data_prefix)
MIN_VERSION = (1, 9)
STATE_FILE = "terraform.tfstate"
DATA_DIR = ".terraform"

#: Terraform reads TF_DATA_DIR from the environment only, and python-terraform passes a copy of
#: os.environ to each command: commands that set it run one at a time
_ENV_LOCK = threading.Lock()


class TerraformRunner:
    """One Terraform module applied for one cluster, its state under `state_dir`.

    Args:
        working_dir: the module, e.g. `sparknet.cluster.spec.INFRA_DIR`.
        state_dir: this cluster's directory for state (made if missing).
        backend_config: settings for a backend the user configured instead of the local one
            (``-backend-config`` pairs); default ``None``: local state in `state_dir`.
        terraform_bin: the Terraform executable, found on PATH.
        plugin_cache_dir: where provider plugins are cached across clusters; default
            ``$TF_PLUGIN_CACHE_DIR`` or ``~/.cache/sparknet/terraform-plugins``.
        plugin_dir: a local directory of providers (holding ``registry.terraform.io/``) that
            `init` takes them from instead of downloading (``-plugin-dir``), for machines
            without the registry; default ``None``: the registry, through the cache.

    Example::

        runner = TerraformRunner(INFRA_DIR, Path("~/.sparknet/clusters/demo/terraform"))
        runner.init()
        runner.apply({"cluster": "demo", "region": "us-east-1", ...})
        runner.output()["security_group_id"]
        runner.destroy({"cluster": "demo", "region": "us-east-1", ...})
    """

    def __init__(
        self,
        working_dir: Path | str,
        state_dir: Path | str,
        *,
        backend_config: Mapping[str, str] | None = None,
        terraform_bin: str = "terraform",
        plugin_cache_dir: Path | str | None = None,
        plugin_dir: Path | str | None = None,
    ) -> None:
        binary = shutil.which(terraform_bin)
        if binary is None:
            raise SparknetError(
                f"{terraform_bin} is not on PATH: install Terraform >= "
                f"{'.'.join(map(str, MIN_VERSION))} "
                "(https://developer.hashicorp.com/terraform/install) or use foundation: boto3"
            )
        self.working_dir = Path(working_dir).resolve()
        if not any(self.working_dir.glob("*.tf")):
            raise SparknetError(f"no Terraform module (*.tf) in {self.working_dir}")
        self.state_dir = Path(state_dir).expanduser().resolve()
        self.backend_config = dict(backend_config) if backend_config is not None else None
        self.plugin_cache_dir = Path(
            plugin_cache_dir
            or os.environ.get("TF_PLUGIN_CACHE_DIR")
            or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
            / "sparknet"
            / "terraform-plugins"
        ).expanduser()
        self.plugin_dir = Path(plugin_dir).expanduser().resolve() if plugin_dir else None
        self._tf = Terraform(working_dir=str(self.working_dir), terraform_bin_path=binary)

    @property
    def state_file(self) -> Path | None:
        """The local state file, or ``None`` when a user-configured backend holds the state."""
        return self.state_dir / STATE_FILE if self.backend_config is None else None

    def init(self) -> None:
        """Prepare the module for this cluster: backend, providers. Safe to repeat."""
        self._check_version()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.plugin_cache_dir.mkdir(parents=True, exist_ok=True)
        backend = self.backend_config
        if backend is None:
            backend = {"path": str(self.state_dir / STATE_FILE)}
        if self.plugin_dir is None:
            # reconfigure=None: a changed backend fails loudly instead of leaving state behind
            self._run("init", backend_config=backend, reconfigure=None, input=False)
            return
        try:
            self._run(
                "init", backend_config=backend, reconfigure=None, input=False,
                plugin_dir=str(self.plugin_dir),
            )  # fmt: skip
        except SparknetError as exc:
            raise SparknetError(
                "{cause} (providers only from {plugins})", cause=exc, plugins=self.plugin_dir
            ) from exc

    def _var_file(self, variables: Mapping[str, Any]) -> str:
        """`variables` as a JSON var-file in the state dir: lists, maps and bools reach Terraform
        typed, where `-var k=v` would pass Python's repr of a list."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / "variables.tfvars.json"
        path.write_text(json.dumps(dict(variables), indent=1))
        return str(path)

    def apply(self, variables: Mapping[str, Any]) -> None:
        """Create or update the resources so they match the module and `variables`."""
        self._run("apply", auto_approve=IsFlagged, var_file=self._var_file(variables))

    def plan(self, variables: Mapping[str, Any]) -> bool:
        """Whether applying `variables` would change anything (drift or a changed input)."""
        code, _ = self._run(
            "plan", ok=(0, 2), var_file=self._var_file(variables), detailed_exitcode=IsFlagged
        )
        return code == 2

    def output(self) -> dict[str, Any]:
        """The module's outputs as plain values (``{name: value}``); empty before any apply."""
        _, out = self._run("output", json=IsFlagged, no_color=IsFlagged)
        try:
            raw = json.loads(out or "{}")
        except json.JSONDecodeError as err:
            raise SparknetError(f"terraform output -json printed something else: {err}") from None
        return {name: entry["value"] for name, entry in raw.items()}

    def resources(self) -> list[tuple[str, dict[str, Any]]]:
        """``(type, attributes)`` of every managed resource in the state (any backend), e.g.
        ``("aws_vpc", {"id": "vpc-...", ...})``; empty before any apply."""
        _, out = self._run("show", json=IsFlagged, no_color=IsFlagged)
        try:
            shown = json.loads(out or "{}")
        except json.JSONDecodeError as err:
            raise SparknetError(f"terraform show -json printed something else: {err}") from None
        found: list[tuple[str, dict[str, Any]]] = []
        modules = [shown.get("values", {}).get("root_module", {})]
        while modules:
            module = modules.pop()
            found += [
                (r["type"], r.get("values") or {})
                for r in module.get("resources", [])
                if r.get("mode") == "managed"
            ]
            modules += module.get("child_modules", [])
        return found

    def destroy(self, variables: Mapping[str, Any]) -> None:
        """Delete every resource in this cluster's state."""
        self._run("destroy", auto_approve=IsFlagged, var_file=self._var_file(variables))

    def _check_version(self) -> None:
        _, text = self._run("version", json=IsFlagged)
        try:
            version = json.loads(text)["terraform_version"]
        except (json.JSONDecodeError, KeyError):
            return  # an unusual build; `required_version` in the module still guards
        parts = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
        if parts < MIN_VERSION:
            raise SparknetError(
                f"terraform {version} is too old: sparknet's modules need Terraform >= "
                f"{'.'.join(map(str, MIN_VERSION))}"
            )

    def _run(self, command: str, ok: tuple[int, ...] = (0,), **options: Any) -> tuple[int, str]:
        """Run `terraform <command>`: its exit code and stdout, or a SparknetError with its first
        error when the exit code is not in `ok`."""
        if command in _PROMPTING:
            options = {"input": False, "no_color": IsFlagged, **options}
        argv = self._tf.generate_cmd_string(command, **options)
        with self._environment():
            code, out, err = _communicate(argv, self.working_dir)
        if code not in ok:
            raise SparknetError(f"terraform {command} failed: {first_error(err, code)}")
        return code, out

    @contextmanager
    def _environment(self) -> Iterator[None]:
        settings = {
            "TF_DATA_DIR": str(self.state_dir / DATA_DIR),
            "TF_PLUGIN_CACHE_DIR": str(self.plugin_cache_dir),
            "TF_IN_AUTOMATION": "1",
            "TF_INPUT": "0",
        }
        with _ENV_LOCK, warnings.catch_warnings():
            # python-terraform 0.10 logs failures with the deprecated Logger.warn
            warnings.simplefilter("ignore", DeprecationWarning)
            with variables(settings):
                yield


#: commands that would ask for input and colour their output unless told not to
_PROMPTING = frozenset({"apply", "destroy", "init", "plan"})
#: how long an interrupted Terraform may take to stop: it finishes the API calls in flight,
#: writes its state and releases the state lock
STOP_WAIT_S = 300.0


def _communicate(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """Run one Terraform command to its end: exit code, stdout, stderr.

    Terraform runs in its own session, so a Ctrl-C at the terminal reaches sparknet alone and
    Terraform gets exactly one SIGINT, from here (a second one would make it exit at once,
    state unwritten and locked). When sparknet is interrupted (Ctrl-C, SIGTERM: any exception
    while it waits), Terraform is told to stop and waited for: it finishes the calls in flight,
    records what it made in the state and releases the lock, so the clean-up that follows can
    destroy all of it. Only after `STOP_WAIT_S` is it killed.
    """
    proc = subprocess.Popen(
        argv, cwd=cwd, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate()
    except BaseException:
        _stop(proc)
        raise
    return proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop Terraform gracefully (one SIGINT) and wait for it, through further interrupts."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_WAIT_S
    while True:
        try:
            proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            return
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return
        except BaseException:  # a second Ctrl-C must not orphan a running apply
            continue


def first_error(stderr: str | None, code: int) -> str:
    """The first ``Error:`` diagnostic of Terraform's stderr as one line: its summary, then the
    first paragraph of its detail (source snippets skipped). Boxed warnings (``╷ │ ╵``) are
    dropped; boxed errors are read like plain ones.

    >>> first_error("Warning: x\\n\\nError: Invalid value for variable\\n\\n  on a.tf line 1:\\n"
    ...             "   1: x\\n\\ncluster must match\\n^[a-z]+$.\\n\\nThis was checked by ...", 1)
    'Invalid value for variable: cluster must match ^[a-z]+$.'
    """
    lines = _unbox((stderr or "").splitlines())
    start = next((i for i, line in enumerate(lines) if line.startswith("Error: ")), None)
    if start is None:
        rest = [line.strip() for line in lines if line.strip()]
        return f"exit code {code}" + (f": {rest[-1]}" if rest else "")
    summary = lines[start].removeprefix("Error: ").strip()
    detail: list[str] = []
    for line in lines[start + 1 :]:
        if line.startswith(("Error: ", "Warning: ")) or (detail and not line.strip()):
            break
        if line.strip() and not line.startswith(" "):  # indented: the source snippet
            detail.append(line.strip())
    return f"{summary}: {' '.join(detail)}" if detail else summary


def _unbox(lines: list[str]) -> list[str]:
    """Terraform's diagnostics without their box: warnings dropped, errors kept, unindented."""
    kept: list[str] = []
    box: list[str] | None = None
    for line in lines:
        if line.startswith("╷"):
            box = []
        elif line.startswith("╵") and box is not None:
            if any(inner.startswith("Error: ") for inner in box):
                kept.extend([*box, ""])
            box = None
        elif box is not None:
            box.append(line.removeprefix("│").removeprefix(" "))
        else:
            kept.append(line)
    return kept
