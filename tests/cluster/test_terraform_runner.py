"""TerraformRunner runs Terraform for real (init, apply, output, destroy) on a provider-free module
of `terraform_data` resources (tests/terraform_module/), offline, ~0.1 s a command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparknet.cluster.aws.terraform import TerraformRunner, first_error
from sparknet.errors import SparknetError

pytestmark = pytest.mark.integration

MODULE = Path(__file__).resolve().parents[1] / "terraform_module"


def make_runner(tmp_path: Path, cluster: str) -> TerraformRunner:
    return TerraformRunner(
        MODULE,
        tmp_path / "clusters" / cluster / "terraform",
        plugin_cache_dir=tmp_path / "plugins",
    )


@pytest.fixture
def runner(tmp_path):
    runner = make_runner(tmp_path, "demo")
    runner.init()
    yield runner
    if runner.state_file.exists() and state_resources(runner):
        runner.destroy({"cluster": "demo"})


def state_resources(runner: TerraformRunner) -> list[dict]:
    return json.loads(runner.state_file.read_text())["resources"]


def resource_ids(runner: TerraformRunner) -> dict[str, str]:
    return {
        f"{r['name']}[{i.get('index_key', '')}]": i["attributes"]["id"]
        for r in state_resources(runner)
        for i in r["instances"]
    }


def test_apply_then_output_gives_plain_values(runner) -> None:
    runner.apply({"cluster": "demo", "subnet_count": 2})
    assert runner.output() == {
        "vpc_id": "vpc-demo",
        "subnet_ids": ["vpc-demo-subnet-0", "vpc-demo-subnet-1"],
        "tags": {"sparknet:cluster": "demo", "sparknet:role": "foundation"},
    }


def test_state_lives_in_the_cluster_dir_not_the_module(runner, tmp_path) -> None:
    runner.apply({"cluster": "demo"})
    cluster_dir = tmp_path / "clusters" / "demo" / "terraform"
    assert runner.state_file == cluster_dir / "terraform.tfstate"
    assert len(state_resources(runner)) == 2
    assert (cluster_dir / ".terraform").is_dir()  # TF_DATA_DIR: backend settings of this cluster
    leftovers = [p.name for p in MODULE.iterdir() if p.name != "main.tf"]
    assert not leftovers, f"terraform wrote into the module dir: {leftovers}"


def test_second_apply_changes_nothing(runner) -> None:
    assert runner.plan({"cluster": "demo"}) is True
    runner.apply({"cluster": "demo"})
    before = resource_ids(runner)
    assert runner.plan({"cluster": "demo"}) is False
    runner.apply({"cluster": "demo"})
    assert resource_ids(runner) == before  # nothing replaced
    assert runner.plan({"cluster": "demo", "subnet_count": 3}) is True


def test_destroy_leaves_an_empty_state(runner) -> None:
    runner.apply({"cluster": "demo"})
    runner.destroy({"cluster": "demo"})
    assert state_resources(runner) == []
    assert runner.output() == {}


def test_two_clusters_keep_separate_states(tmp_path) -> None:
    first, second = make_runner(tmp_path, "first"), make_runner(tmp_path, "second")
    for runner, name in [(first, "first"), (second, "second")]:
        runner.init()
        runner.apply({"cluster": name, "subnet_count": 1})
    first.destroy({"cluster": "first"})
    assert state_resources(first) == []
    assert second.output()["vpc_id"] == "vpc-second"
    second.destroy({"cluster": "second"})


def test_init_again_is_harmless(runner) -> None:
    runner.apply({"cluster": "demo", "subnet_count": 1})
    runner.init()
    assert runner.output()["subnet_ids"] == ["vpc-demo-subnet-0"]


def test_invalid_variable_is_a_one_line_error(runner) -> None:
    with pytest.raises(SparknetError, match=r"cluster must match") as err:
        runner.apply({"cluster": "Not_A_Name"})
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("terraform apply failed: Invalid value for variable:")
    assert not runner.state_file.exists() or state_resources(runner) == []


def test_missing_required_variable_is_a_one_line_error(runner) -> None:
    with pytest.raises(SparknetError, match=r"^terraform apply failed: No value for required") as e:
        runner.apply({})
    assert "\n" not in str(e.value)


def test_missing_terraform_binary_is_a_one_line_error(tmp_path) -> None:
    with pytest.raises(SparknetError, match=r"^terraform-missing is not on PATH: install") as err:
        TerraformRunner(MODULE, tmp_path, terraform_bin="terraform-missing")
    assert "\n" not in str(err.value)


def test_a_dir_without_a_module_is_refused(tmp_path) -> None:
    with pytest.raises(SparknetError, match=r"no Terraform module"):
        TerraformRunner(tmp_path, tmp_path / "state")


BOXED = """There are some problems with the CLI configuration:
╷
│ Warning: Unable to open CLI configuration file
│
│ The CLI configuration file at "/root/.terraformrc" does not exist.
╵

╷
│ Error: Backend configuration changed
│
│ A change in the backend configuration has been detected, which may require
│ migrating existing state.
│
│ If you wish to attempt automatic migration of the state, use ...
╵
"""


def test_first_error_reads_boxed_diagnostics_and_skips_warnings() -> None:
    assert first_error(BOXED, 1) == (
        "Backend configuration changed: A change in the backend configuration has been "
        "detected, which may require migrating existing state."
    )


def test_first_error_without_a_diagnostic_names_the_exit_code() -> None:
    warning_only = BOXED[: BOXED.index("\n\n╷")]
    assert first_error(warning_only, 3) == (
        "exit code 3: There are some problems with the CLI configuration:"
    )
    assert first_error("panic: runtime error\n", 2) == "exit code 2: panic: runtime error"
    assert first_error("", 3) == "exit code 3"


def test_plugin_dir_is_where_init_looks_for_providers(tmp_path) -> None:
    """With `plugin_dir`, init takes providers from that directory only (no registry): a
    provider missing there is a one-line error that names the directory, at once."""
    module = tmp_path / "needs-aws"
    module.mkdir()
    (module / "main.tf").write_text(
        'terraform {\n  required_providers {\n    aws = { source = "hashicorp/aws" }\n  }\n}\n'
    )
    empty = tmp_path / "no-plugins"
    empty.mkdir()
    runner = TerraformRunner(module, tmp_path / "state", plugin_dir=empty)
    with pytest.raises(SparknetError, match=r"^terraform init failed: .*hashicorp/aws") as err:
        runner.init()
    message = str(err.value)
    assert "not found in any of the search locations" in message  # not the registry's answer
    assert message.endswith(f"(providers only from {empty})") and "\n" not in message


def test_resources_lists_the_managed_resources_of_the_state(runner) -> None:
    assert runner.resources() == []
    runner.apply({"cluster": "demo", "subnet_count": 1})
    found = runner.resources()
    assert sorted(kind for kind, _ in found) == ["terraform_data", "terraform_data"]
    assert sorted(values["id"] for _, values in found) == sorted(resource_ids(runner).values())


def test_an_interrupt_stops_terraform_gracefully_and_releases_the_state_lock(tmp_path) -> None:
    """A signal to this process alone (as `kill PID` sends it) while an apply runs: Terraform
    is told to stop and waited for, so the state lock is free for the destroy that follows
    (issue 9 probe, point 3: "Error acquiring the state lock")."""
    import os
    import signal
    import threading
    import time

    marker = tmp_path / "started"
    module = tmp_path / "slow"
    module.mkdir()
    (module / "main.tf").write_text(
        'terraform {\n  backend "local" {}\n}\n\n'
        'resource "terraform_data" "slow" {\n'
        '  provisioner "local-exec" {\n'
        f'    command = "touch {marker} && exec sleep 60"\n'
        "  }\n}\n"
    )
    runner = TerraformRunner(module, tmp_path / "state", plugin_cache_dir=tmp_path / "plugins")
    runner.init()

    def interrupt_once_started() -> None:
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own SIGINT handler, whatever an earlier test in this worker process left (a
    # SparkContext installs one of its own): what a `kill PID` meets in the CLI
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_once_started, daemon=True).start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            runner.apply({})
    finally:
        signal.signal(signal.SIGINT, before)
    assert marker.exists()
    assert time.monotonic() - started < 50  # the provisioner was stopped, not sat out
    assert not (runner.state_dir / ".terraform.tfstate.lock.info").exists()
    runner.destroy({})  # no "Error acquiring the state lock"
    assert runner.resources() == []
