"""The image definition (ami/image.toml), the clean-up command, AWS's naming rules the bake checks
itself (moto checks none of them) and the CLI's one-line refusals of bad options."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparknet.cluster import ami, bootstrap
from sparknet.errors import SparknetError


def test_the_image_runs_bootstraps_install_steps_in_order_and_no_cluster_step():
    image = ami.load_image()
    names = [cls.name for cls in image.steps]
    assert names == ["dirs", "java", "nvidia-driver", "python-env", "pyspark", "sparknet"]
    # the very classes `cluster up` runs (no second copy), in bootstrap's order
    assert list(image.steps) == [cls for cls in bootstrap.PREPARE if cls.name in names]
    assert "/etc/ssh/ssh_host_*" in image.remove and "/var/log" in image.empty


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('steps = ["dirs", "spark-conf"]', "step 'spark-conf' belongs to a cluster"),
        ('steps = ["dirs", "docker"]', "no bootstrap step 'docker'; steps.py has dirs, java"),
        ('remove = ["etc/ssh/*"]', "'etc/ssh/*' is not an absolute path"),
        ('remove = ["/var/../etc"]', "'/var/../etc' is not an absolute path"),
        ('remove = ["/tmp/$(reboot)"]', "is not an absolute path"),
        ("steps = [", "image.toml: "),
    ],
)
def test_a_bad_image_definition_is_one_line(tmp_path: Path, text: str, message: str):
    path = tmp_path / "image.toml"
    path.write_text(text + "\n")
    with pytest.raises(SparknetError) as caught:
        ami.load_image(path)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_cleanup_removes_what_is_listed_under_its_root_and_keeps_the_rest(tmp_path: Path):
    root, prefix = tmp_path / "root", tmp_path / "pre fix"  # a space: quoted, not split
    for rel in ("etc/ssh/ssh_host_rsa_key", "etc/ssh/sshd_config", "var/log/a/b.log"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")
    (prefix / "conf").mkdir(parents=True)
    (prefix / "conf" / "spark-defaults.conf").write_text("spark.authenticate.secret x")
    image = ami.Image((), ("/etc/ssh/ssh_host_*", "/home/*/.bash_history", "{prefix}/conf/*"),
                      ("/var/log", "/var/missing"))  # fmt: skip
    command = ami.cleanup_command(image, str(prefix), str(root))
    subprocess.run(["sh", "-c", command], check=True)  # globs matching nothing are no error
    assert not (root / "etc/ssh/ssh_host_rsa_key").exists()
    assert (root / "etc/ssh/sshd_config").exists()
    assert not (root / "var/log/a/b.log").exists() and (root / "var/log/a").is_dir()
    assert (prefix / "conf").is_dir() and not any((prefix / "conf").iterdir())


def hygiene_root(root: Path, *, dbus_link: bool) -> dict[str, Path]:
    """A fake builder root with the identity, caches and lists the image must not carry; the
    D-Bus machine id a symlink to /etc/machine-id (as on Ubuntu) or a file of its own."""
    files = {
        "machine id": "etc/machine-id",
        "apt list": "var/lib/apt/lists/archive.ubuntu.com_ubuntu_dists_jammy_InRelease",
        "apt cache": "var/cache/apt/pkgcache.bin",
        "apt archive": "var/cache/apt/archives/openjdk-17.deb",
        "root pip cache": "root/.cache/pip/http-v2/a/b",
        "user pip cache": "home/ubuntu/.cache/pip/wheels/c",
        "user cache": "home/ubuntu/.cache/other/kept",
    }
    out = {}
    for what, rel in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"{what}\n")
        out[what] = root / rel
    dbus = root / "var/lib/dbus/machine-id"
    dbus.parent.mkdir(parents=True)
    if dbus_link:
        dbus.symlink_to(root / "etc/machine-id")
    else:
        dbus.write_text("0123456789abcdef\n")
    out["dbus machine id"] = dbus
    return out


@pytest.mark.parametrize("dbus_link", [False, True])
def test_the_image_cleanup_leaves_no_machine_identity_nor_caches(tmp_path: Path, dbus_link: bool):
    root = tmp_path / "root"
    made = hygiene_root(root, dbus_link=dbus_link)
    command = ami.cleanup_command(ami.load_image(), str(tmp_path / "prefix"), str(root))
    subprocess.run(["sh", "-c", command], check=True)
    # truncated, not deleted: systemd makes a new id on the first boot of each instance
    assert made["machine id"].is_file() and made["machine id"].read_text() == ""
    # a D-Bus id of its own goes; a symlink to /etc/machine-id (Ubuntu's) stays
    assert made["dbus machine id"].is_symlink() == dbus_link
    assert made["dbus machine id"].exists() == dbus_link
    for what in ("apt list", "apt cache", "apt archive", "root pip cache", "user pip cache"):
        assert not made[what].exists(), what
    assert (root / "var/lib/apt/lists").is_dir() and (root / "var/cache/apt/archives").is_dir()
    assert made["user cache"].exists()
    # cloud-init's own clean-up runs on the builder itself only (here it would clean this host)
    assert "cloud-init" not in command


def test_the_builders_cleanup_runs_cloud_inits_where_present():
    command = ami.cleanup_command(ami.load_image(), "/opt/sparknet")
    assert command.startswith(
        "if command -v cloud-init >/dev/null 2>&1; then cloud-init clean --logs; fi; "
    )
    truncated = 'for f in /etc/machine-id; do if [ -f "$f" ]; then : > "$f"; fi; done'
    assert truncated in command and "rm -rf -- /etc/ssh/ssh_host_* " in command


@pytest.mark.parametrize("name", ["/aws/x", "awsx", "/ssm/x", "SSM-x", "a/b", "/x y", ""])
def test_ssm_parameter_names_aws_refuses_are_refused(name: str):
    with pytest.raises(SparknetError, match="SSM parameter name"):
        ami.check_parameter_name(name)
    assert ami.check_parameter_name("/sparknet/ami/latest") == "/sparknet/ami/latest"


def test_an_image_name_keeps_to_awss_characters():
    assert ami.image_name("0.1.0", "bake-1-ab") == "sparknet-0.1.0-bake-1-ab"
    assert ami.image_name("0.1.0+g1a2b", "bake-1-ab") == "sparknet-0.1.0_g1a2b-bake-1-ab"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--base-ami", "ami-12345678", "--ami-parameter", "/x"], "not both"),
        (["--allowed-cidr", "0.0.0.0/0"], "--allowed-cidr: SSH from 0.0.0.0/0 is open"),
        (["--region", "nowhere-1"], "nowhere-1"),
    ],
)
def test_bad_bake_options_are_one_line_and_exit_2(args: list[str], message: str):
    from sparknet.cli import app

    result = CliRunner().invoke(app, ["ami", "bake", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
