"""The user data of every instance sparknet launches: valid under cloud-init's own schema (the
Debian package's `cloud-init schema`, the validator a node's cloud-init runs), and a backstop
that, booted as cloud-init boots it (tests/sshd.py `boot`, with the stand-in `shutdown`),
schedules a power-off the bootstrap's `BackstopOff` cancels. That the power-off ends the
instances on moto is test_backstop.py's; that a finished `up` cancels it on every node,
test_cluster_bootstrap.py's."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from sparknet.cluster import ami
from sparknet.cluster.aws import keys, userdata
from sparknet.cluster.spec import MAX_BACKSTOP_MINUTES, MIN_BACKSTOP_MINUTES, ClusterSpec
from sparknet.node import files
from tests.sshd import boot, scheduled_shutdown, shutdown_env

CLOUD_INIT = shutil.which("cloud-init")


def schema_errors(text: str, tmp_path: Path) -> str:
    """cloud-init's verdict on `text` as user data: '' when valid, else its message."""
    assert CLOUD_INIT, "cloud-init is not installed: apt-get install cloud-init (.ci/run does)"
    path = tmp_path / "user-data"
    path.write_text(text)
    done = subprocess.run(
        [CLOUD_INIT, "schema", "--config-file", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if done.returncode == 0 and "Valid cloud-config" in done.stdout:
        return ""
    return (done.stdout + done.stderr).strip() or f"exit {done.returncode}"


def every_user_data() -> dict[str, str]:
    """Each user data sparknet writes: a cluster's nodes (the default backstop and both ends of
    its range) and the AMI builder's."""
    spec = ClusterSpec(name="ud")
    bake = ami.builder_backstop_minutes(spec, timeout_s=3600)
    return {
        "node, default backstop": keys.host_key_user_data(spec.backstop_minutes)[0],
        "node, shortest backstop": keys.host_key_user_data(MIN_BACKSTOP_MINUTES)[0],
        "node, longest backstop": keys.host_key_user_data(MAX_BACKSTOP_MINUTES)[0],
        "AMI builder": keys.host_key_user_data(bake)[0],
    }


def test_every_user_data_passes_cloud_inits_schema(tmp_path) -> None:
    errors = {what: schema_errors(text, tmp_path) for what, text in every_user_data().items()}
    assert errors == dict.fromkeys(errors, "")


def test_the_schema_check_refuses_what_cloud_init_refuses(tmp_path) -> None:
    """The check itself: cloud-init 22.4's schema refuses an empty `ssh_genkeytypes`."""
    bad = "#cloud-config\n" + yaml.safe_dump({"ssh_deletekeys": True, "ssh_genkeytypes": []})
    assert "ssh_genkeytypes: [] is too short" in schema_errors(bad, tmp_path)


def test_the_host_key_is_the_only_one_and_pinned_from_the_user_data() -> None:
    text, public = keys.host_key_user_data(60)
    config = yaml.safe_load(text)
    assert config["ssh_deletekeys"] is True
    assert set(config["ssh_keys"]) == {"ed25519_private", "ed25519_public"}
    assert "ssh_genkeytypes" not in config  # given `ssh_keys`, cloud-init makes no other key
    assert keys.host_public_key(text) == public


def test_the_backstop_powers_off_after_its_minutes_at_every_boot(tmp_path) -> None:
    """Booted as cloud-init boots a node, the user data schedules a power-off (not a halt:
    EC2 leaves a halted instance running) `minutes` from the boot; a second boot schedules it
    afresh. The bootstrap's cancel command removes it and the script."""
    text = keys.host_key_user_data(45)[0]
    node = tmp_path / "node"
    env = shutdown_env(node)
    before = time.time()
    assert boot(text, node, env) == [userdata.BACKSTOP_SCRIPT]
    pending = scheduled_shutdown(node)
    assert pending is not None and pending["mode"] == "poweroff"
    assert before + 45 * 60 <= pending["at"] <= time.time() + 45 * 60
    assert boot(text, node, env) == [userdata.BACKSTOP_SCRIPT]
    assert scheduled_shutdown(node) is not None

    script = str(node / "per-boot" / Path(userdata.BACKSTOP_SCRIPT).name)  # as booted
    # the shutdown as logind says (the stand-in busctl)
    assert armed(env, script) == [userdata.ARMED_SCRIPT, userdata.ARMED_SHUTDOWN]

    as_root = root_login(node, env)
    assert backstop("cancel", script, as_root).returncode == 0
    assert scheduled_shutdown(node) is None
    assert armed(env, script) == []


def backstop(action: str, script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The package's backstop script (`userdata.BACKSTOP_TOOL`) run as the node's `sh -s`
    runs it, with `action` and the per-boot `script` (the node's, never this machine's)."""
    return subprocess.run(
        ["sh", "-s", "--", action, script], input=files.script(userdata.BACKSTOP_TOOL),
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def armed(env: dict[str, str], script: str) -> list[str]:
    """What `armed` finds of the backstop on this machine as a node with `env`."""
    done = backstop("armed", script, env)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def root_login(where: Path, env: dict[str, str], uid: int = 0, sudo_log: Path | None = None):
    """`env` with stand-ins first on its PATH (in `where`/login): an `id` that says the login
    user's `uid` (the tests run as whoever runs them), and a `sudo` that runs its command,
    writing it to `sudo_log`."""
    tools = where / "login"
    tools.mkdir(parents=True, exist_ok=True)
    log = sudo_log or where / "sudo.log"
    for name, body in {
        "id": f"echo {uid}",
        "sudo": f'[ "$1" = -n ] && shift; echo "sudo $*" >> {log}; exec "$@"',
    }.items():
        (tools / name).write_text(f"#!/bin/sh\n{body}\n")
        (tools / name).chmod(0o755)
    return {**env, "PATH": f"{tools}:{env['PATH']}"}


def test_the_cancel_passes_on_an_image_without_shutdown(tmp_path) -> None:
    """An image without `shutdown` (or with it off root's PATH) never had a backstop scheduled
    (its per-boot script exits 127): the cancel removes the script and succeeds, so the
    bootstrap can finish, and nothing reads as armed there (no logind's `busctl` either)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "rm"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    script = tmp_path / "per-boot" / "sparknet-backstop"
    script.parent.mkdir()
    script.write_text(userdata.backstop_script(60))
    script.chmod(0o755)
    env = {"PATH": str(bin_dir)}
    assert subprocess.run(str(script), env=env, capture_output=True, timeout=30).returncode == 127

    done = backstop("cancel", str(script), root_login(tmp_path, env))
    assert done.returncode == 0, done.stderr
    assert not script.exists()
    found = backstop("armed", str(script), env)
    assert (found.returncode, found.stdout) == (0, "")


def test_the_cancel_runs_as_root_through_sudo_for_a_login_user(tmp_path) -> None:
    """On an image's own user (uid 1000, as on EC2) the cancel goes through `sudo -n`: the
    script is root's, and so is a scheduled shutdown."""
    node = tmp_path / "node"
    env = shutdown_env(node)
    boot(keys.host_key_user_data(45)[0], node, env)
    script = node / "per-boot" / Path(userdata.BACKSTOP_SCRIPT).name
    log = tmp_path / "sudo.log"
    done = backstop("cancel", str(script), root_login(tmp_path, env, 1000, log))
    assert done.returncode == 0, done.stderr
    assert not script.exists() and scheduled_shutdown(node) is None
    assert log.read_text().splitlines() == [
        f"sudo rm -f {script}",
        "sudo sh -c command -v shutdown >/dev/null || exit 0; exec shutdown -c",
    ]


def test_no_backstop_without_an_executable_per_boot_script(tmp_path) -> None:
    """The emulated boot runs only what cloud-init runs: a script left at cloud-init's default
    mode 0644 never runs, so user data that loses the mode loses the backstop (and the test
    of it fails)."""
    config = yaml.safe_load(keys.host_key_user_data(45)[0])
    del config["write_files"][0]["permissions"]
    text = "#cloud-config\n" + yaml.safe_dump(config)
    assert boot(text, tmp_path / "node", shutdown_env(tmp_path / "node")) == []
    assert scheduled_shutdown(tmp_path / "node") is None


@pytest.mark.parametrize("minutes", [0, MIN_BACKSTOP_MINUTES - 1, MAX_BACKSTOP_MINUTES + 1])
def test_the_backstop_setting_refuses_minutes_out_of_range(minutes) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="backstop_minutes"):
        ClusterSpec(name="ud", backstop_minutes=minutes)


def test_backstop_off_cancels_where_a_backstop_is_left() -> None:
    """It applies where the node still has a backstop (the script, or a scheduled shutdown),
    and not where it has none: a second bootstrap of a finished cluster applies nothing."""
    from sparknet.cluster.spark.daemons import BackstopOff
    from tests.cluster.test_bootstrap_parts import Recorder, systemd_master

    class Node(Recorder):
        """A node whose backstop is armed until the cancel runs."""

        def __init__(self, armed: str) -> None:
            super().__init__()
            self.armed = armed

        def run(self, command: str, **kwargs):
            if command == asked:
                self.commands.append(command)
                from invoke.runners import Result

                return Result(stdout=self.armed, exited=0, command=command)
            if command == cancel:
                self.armed = ""
            return super().run(command, **kwargs)

    asked = f"sh -s -- armed {userdata.BACKSTOP_SCRIPT}"
    cancel = f"sh -s -- cancel {userdata.BACKSTOP_SCRIPT}"
    for armed in ("script\nshutdown\n", "shutdown\n", "script\n"):
        step, conn = BackstopOff(systemd_master("worker-1")), Node(armed)
        assert not step.check(conn)
        step.apply(conn)
        assert step.check(conn)
        assert [c for c in conn.commands if c != asked] == [cancel]
    assert BackstopOff(systemd_master("worker-1")).check(Node(""))
