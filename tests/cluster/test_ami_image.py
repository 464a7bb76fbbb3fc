"""The image definition (ami/image.toml), the clean-up command, AWS's naming rules the bake checks
itself (moto checks none of them) and the CLI's one-line refusals of bad options."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparknet.cluster import ami
from sparknet.cluster.aws import images
from sparknet.cluster.spark import bootstrap
from sparknet.errors import SparknetError


def test_the_image_runs_bootstraps_install_steps_in_order_and_no_cluster_step():
    image = ami.load_image()
    names = [cls.name for cls in image.steps]
    assert names == ["python", "dirs", "java", "nvidia-driver", "python-env", "pyspark", "sparknet"]
    # the very classes `cluster up` runs (no second copy), in bootstrap's order
    assert list(image.steps) == [cls for cls in bootstrap.PREPARE if cls.name in names]
    assert "/etc/ssh/ssh_host_*" in image.remove and "/var/log" in image.empty


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('steps = ["dirs", "spark-conf"]', "step 'spark-conf' belongs to a cluster"),
        ('steps = ["dirs", "docker"]', "no bootstrap step 'docker'; steps.py has python, dirs"),
        ('remove = ["etc/ssh/*"]', "'etc/ssh/*' is not an absolute path"),
        ('remove = ["/var/../etc"]', "'/var/../etc' is not an absolute path"),
        ('remove = ["/tmp/$(reboot)"]', "is not an absolute path"),
        ("steps = [", "image.toml: "),
        ('home = ["/root/.aws"]', "home: '/root/.aws' is not a path or glob relative to a home"),
        ('home = ["../.aws"]', "'../.aws' is not a path or glob relative to a home"),
        ('scan = ["opt"]', "scan: 'opt' is not an absolute path"),
        ('scan_skip = ["*/x;reboot"]', "scan_skip: '*/x;reboot' is not a find -path pattern"),
    ],
)
def test_a_bad_image_definition_is_one_line(tmp_path: Path, text: str, message: str):
    path = tmp_path / "image.toml"
    path.write_text(text + "\n")
    with pytest.raises(SparknetError) as caught:
        ami.load_image(path)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_cleanup_removes_what_is_listed_under_its_root_and_keeps_the_rest(tmp_path: Path):
    # a space: quoted, not split; brackets: a path, not a glob
    root, prefix = tmp_path / "root", tmp_path / "pre fix[1]"
    for rel in ("etc/ssh/ssh_host_rsa_key", "etc/ssh/sshd_config", "var/log/a/b.log"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")
    (tmp_path / "pre fix1" / "conf").mkdir(parents=True)
    (tmp_path / "pre fix1" / "conf" / "other").write_text("not the prefix's")
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
    assert (tmp_path / "pre fix1" / "conf" / "other").exists()


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
        "user cache": "home/ubuntu/.cache/other/x",
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
    for what in ("apt list", "apt cache", "apt archive", "root pip cache", "user pip cache",
                 "user cache"):  # fmt: skip
        assert not made[what].exists(), what
    assert (root / "var/lib/apt/lists").is_dir() and (root / "var/cache/apt/archives").is_dir()


def test_the_builders_cleanup_runs_cloud_inits_where_present(tmp_path: Path):
    """On the builder's own root (root "/") clean.sh runs `cloud-init clean --logs` first; on a
    directory standing in for it, never (it would clean the machine the tests run on). No lists:
    nothing else is touched."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "cloud-init").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "cloud-init").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for root in ("/", str(tmp_path / "root")):
        command = ami.cleanup_command(ami.Image((), (), ()), "/opt/sparknet", root)
        subprocess.run(["sh", "-c", command], check=True, env=env)
    assert calls.read_text() == "clean --logs\n"


PEM_HEADER = "-----BEGIN " + "OPENSSH PRIVATE KEY-----"  # split: no scanner flags this file
PEM_KEY = f"{PEM_HEADER}\nb3BlbnNzaC1rZXktdjEAAAAAnotakey\n-----END OPENSSH PRIVATE KEY-----\n"

#: what issue 23 found surviving the clean-up, planted in each home: root's, two of /home's, and
#: a login user's home outside /home
IN_EVERY_HOME = (
    ".aws/credentials", ".aws/config", ".ssh/id_ed25519", ".ssh/id_ed25519.pub",
    ".ssh/authorized_keys", ".ssh/known_hosts", ".cache/huggingface/token",
    ".cache/torch/kernels/k.bin", ".cache/pip/http/a", ".python_history", ".bash_history",
    ".viminfo", ".lesshst", ".netrc", ".git-credentials", ".docker/config.json",
    ".gnupg/private-keys-v1.d/k.key", ".ipython/profile_default/history.sqlite",
)  # fmt: skip
HOMES = ("root", "home/ubuntu", "home/someone", "srv/login")
#: the temporary and per-machine state, and the install prefix's own
STATE = (
    "tmp/a", "tmp/.hidden/b", "tmp/dir/c", "var/tmp/d", "var/tmp/.e",
    "var/lib/systemd/random-seed", "var/lib/systemd/credential.secret",
    "etc/ssh/ssh_host_ed25519_key", "etc/ssh/ssh_host_ed25519_key.pub",
    "etc/ssl/private/ssl-cert-snakeoil.key", "var/log/syslog", "var/lib/cloud/instances/i-1/x",
)  # fmt: skip
IN_PREFIX = ("work/app-1/0/stderr", "work/local/blockmgr-1/x", "autostop/deadline",
             "jobs/run-1/driver.log", "logs/master.out", "conf/spark-defaults.conf")  # fmt: skip
KEPT = ("etc/ssh/sshd_config", "home/ubuntu/.bashrc", "root/.profile", "etc/ssl/certs/ca.pem")


def plant(base: Path, rels: tuple[str, ...], text: str = "planted\n") -> list[Path]:
    out = []
    for rel in rels:
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_text(text)
        out.append(base / rel)
    return out


def test_the_cleanup_leaves_no_credential_key_cache_history_nor_machine_state(tmp_path: Path):
    root, prefix = tmp_path / "root", tmp_path / "prefix"
    gone = [p for home in HOMES for p in plant(root / home, IN_EVERY_HOME)]
    gone += plant(root, STATE) + plant(prefix, IN_PREFIX)
    (root / "home/ubuntu/.ssh/id_ed25519").write_text(PEM_KEY)
    (root / "etc/machine-id").write_text("0123456789abcdef\n")
    kept = plant(root, KEPT)
    image = ami.load_image()
    command = ami.cleanup_command(image, str(prefix), str(root), login_home="/srv/login")
    subprocess.run(["sh", "-c", command], check=True)

    assert [p for p in gone if p.exists() or p.is_symlink()] == []
    assert all(p.exists() for p in kept)
    for home in HOMES:  # the homes and their .ssh stay (cloud-init writes a launch key there)
        assert (root / home / ".ssh").is_dir()
    assert sorted(os.listdir(root / "tmp")) == [] and (root / "var/tmp").is_dir()
    assert (root / "etc/machine-id").read_text() == ""
    # the `dirs` step's tree stays (a node from the image skips the step)
    assert (prefix / "work/local").is_dir() and (prefix / "logs").is_dir()
    # and the scan after it finds nothing in what the clean-up leaves
    found = ami.scan_found(run_scan(image, prefix, root, login_home="/srv/login"))
    assert found == {}


def run_scan(image: ami.Image, prefix: Path, root: Path, login_home: str | None = None) -> str:
    command = ami.scan_command(image, str(prefix), str(root), login_home)
    return subprocess.run(["sh", "-c", command], check=True, capture_output=True, text=True).stdout


def test_the_scan_finds_private_keys_and_credentials_where_it_looks_and_nowhere_else(
    tmp_path: Path,
):
    root, prefix = tmp_path / "root", tmp_path / "pre fix"
    plant(root, ("opt/x/key.pem", "etc/ssl/private/site.key", "home/u/notes/deploy"), PEM_KEY)
    plant(prefix, ("conf/server.key",), PEM_KEY)
    plant(root, ("srv/app/credentials", "root/.ssh/id_rsa", "home/u/.cache/huggingface/token"))
    plant(root, ("home/u/.ssh/id_rsa.pub", "etc/ssl/certs/ca.pem", "opt/x/README"))
    # not looked into (scan_skip), or not where it looks (`scan`)
    plant(root, ("opt/env/lib/python3.11/site-packages/tornado/test/test.key",), PEM_KEY)
    plant(root, ("opt/env/lib/python3.11/test/keycert.pem", "usr/share/doc/x/key.pem"), PEM_KEY)
    big = root / "opt/x/big.bin"
    big.write_bytes(b"\0" * 10 + PEM_KEY.encode())  # binary: not read as text

    found = ami.scan_found(run_scan(ami.load_image(), prefix, root, login_home="/nowhere"))
    assert found == {
        "/etc/ssl/private/site.key": "a PEM private key",
        "/home/u/.cache/huggingface/token": "a credential's or private key's name",
        "/home/u/notes/deploy": "a PEM private key",
        "/opt/x/key.pem": "a PEM private key",
        "/root/.ssh/id_rsa": "a credential's or private key's name",
        "/srv/app/credentials": "a credential's or private key's name",
        f"{prefix}/conf/server.key": "a PEM private key",
    }


def test_what_the_scan_finds_fails_the_bake_in_one_line_naming_the_files():
    found = {f"/opt/k{i}.pem": "a PEM private key" for i in range(7)}
    error = ami.scan_refusal("i-0123", found)
    message = str(error)
    assert "\n" not in message
    assert message.startswith("bake refused: after the clean-up the builder i-0123 still holds ")
    assert "/opt/k0.pem (a PEM private key), /opt/k1.pem" in message and "and 2 more" in message
    assert "/opt/k5.pem" not in message and "scan_skip" in message


#: AWS's documentation's example secret access key (40 characters)
EXAMPLE_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


def test_the_scan_finds_an_aws_secret_key_written_into_any_file(tmp_path: Path):
    """An install step that writes the operator's AWS key into /etc/environment, a unit or a
    shell's rc file shipped it in every node's image: only ~/.aws was cleaned, and the scan
    looked only for PEM keys and names. A mention of the name with no key is no secret."""
    root, prefix = tmp_path / "root", tmp_path / "prefix"
    written = {
        "etc/environment": f"AWS_SECRET_ACCESS_KEY={EXAMPLE_SECRET}\n",
        "etc/systemd/system/app.service": f'Environment="AWS_SECRET_ACCESS_KEY={EXAMPLE_SECRET}"\n',
        "home/u/.bashrc": f"export aws_secret_access_key='{EXAMPLE_SECRET}'\n",
        "opt/app/session.json": f'{{"SecretAccessKey": "{EXAMPLE_SECRET}", "Expiration": 1}}\n',
    }
    for rel, text in written.items():
        plant(root, (rel,), text)
    plant(root, ("opt/app/run.sh",), 'AWS_SECRET_ACCESS_KEY="$SECRET" aws s3 ls\n')
    plant(root, ("srv/x.cfg",), f"aws_secret_access_key = {EXAMPLE_SECRET}XY\n")  # 42: no key
    found = ami.scan_found(run_scan(ami.load_image(), prefix, root))
    assert found == {f"/{rel}": "an AWS secret access key" for rel in written}


def test_the_cleanup_follows_no_link_below_a_home_or_the_prefix(tmp_path: Path):
    """A home's and the prefix's directories belong to their users, who may have made one a
    link (`~/.ssh -> /`): root's clean-up once globbed through it and deleted what it leads to.
    Now what lies behind such a link stays, and the clean-up fails naming it (the bake stops);
    a link a glob names itself (`~/.cache`) is removed as a link."""
    root, prefix, outside = tmp_path / "root", tmp_path / "prefix", tmp_path / "outside"
    kept = plant(outside, ("etc/passwd", "bin/sh", "history.sqlite", "work.log"))
    (root / "home/ubuntu/.ipython").mkdir(parents=True)
    (root / "home/ubuntu/.ssh").symlink_to(outside)
    (root / "home/ubuntu/.cache").symlink_to(outside)
    (root / "home/ubuntu/.ipython/profile_x").symlink_to(outside)
    (root / "root").mkdir()
    (root / "root/.ssh").symlink_to(outside / "etc")
    prefix.mkdir()
    (prefix / "logs").symlink_to(outside / "bin")
    (prefix / "work").symlink_to(outside)
    command = ami.cleanup_command(ami.load_image(), str(prefix), str(root), "/home/ubuntu")
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True)

    assert [p for p in kept if not p.is_file()] == []
    assert done.returncode == 1
    said = done.stderr.splitlines()
    assert "clean.sh: /home/ubuntu/.ssh/etc not removed: a symbolic link below /home/ubuntu " \
        "leads there" in said, said  # fmt: skip
    assert f"clean.sh: {prefix}/logs/sh not removed: a symbolic link below {prefix} leads there" \
        in said, said  # fmt: skip
    assert not (root / "home/ubuntu/.cache").is_symlink()  # the link itself: removed
    assert (root / "home/ubuntu/.ssh").is_symlink()


def test_a_failed_clean_up_says_why_in_its_one_line(monkeypatch):
    """The bake's line once said only `master: exited 1`: now also clean.sh's last line."""
    from sparknet.cluster import address, nodes
    from sparknet.cluster.remote import CommandFailed
    from sparknet.cluster.spark.plan import Node, Plan

    said = "clean.sh: /root/.ssh/x not removed: a symbolic link below /root leads there"

    def failing(endpoints, *_args, **_kw):
        raise nodes.NodesFailed(
            "1 of 1 nodes failed: master: exited 1",
            {"master": CommandFailed("exited 1", ["another line", said])},
        )

    monkeypatch.setattr(nodes, "run_all", failing)
    node = Node(address.Endpoint("master", "127.0.0.1"))
    plan = Plan((node,), None, "")  # type: ignore[arg-type]  # the wheel is not looked at
    with pytest.raises(SparknetError) as err:
        ami._versions_and_clean(plan, None, ami.load_image(), "/", "i-0123", print)
    assert str(err.value) == (
        f"bake failed cleaning the builder: 1 of 1 nodes failed: master: exited 1: {said}"
    )


def test_every_home_of_etc_passwd_and_a_linked_home_are_cleaned_and_scanned(tmp_path: Path):
    """Homes outside /home (a service user's under /var/lib, a user's on /data) and a /home entry
    that is a link to one were neither cleaned nor scanned: their keys shipped in the image."""
    root, prefix = tmp_path / "root", tmp_path / "prefix"
    plant(root, ("etc/passwd",))
    (root / "etc/passwd").write_text(
        "root:x:0:0:root:/root:/bin/bash\nsvc:x:998:998::/var/lib/svc:/usr/sbin/nologin\n"
        "bob:x:1001:1001::/data/bob:/bin/bash\nnobody:x:65534:65534::/nonexistent:/bin/false\n"
        "daemon:x:1:1::/:/usr/sbin/nologin\nsshd:x:105:65534::/run/sshd:/usr/sbin/nologin\n"
    )
    secrets = ("var/lib/svc/.aws/credentials", "data/bob/.ssh/id_ed25519", "data/carol/.netrc")
    plant(root, secrets)
    plant(root, ("run/sshd/token",))  # a tmpfs: not in the image, not scanned
    (root / "home").mkdir()
    (root / "home/carol").symlink_to("../data/carol")
    image = ami.load_image()
    found = ami.scan_found(run_scan(image, prefix, root))
    assert set(found) == {
        "/var/lib/svc/.aws/credentials", "/data/bob/.ssh/id_ed25519", "/home/carol/.netrc",
    }  # fmt: skip
    command = ami.cleanup_command(image, str(prefix), str(root))
    subprocess.run(["sh", "-c", command], check=True)
    assert [rel for rel in secrets if (root / rel).exists()] == []
    assert ami.scan_found(run_scan(image, prefix, root)) == {}


@pytest.mark.parametrize("name", ["/aws/x", "awsx", "/ssm/x", "SSM-x", "a/b", "/x y", ""])
def test_ssm_parameter_names_aws_refuses_are_refused(name: str):
    with pytest.raises(SparknetError, match="SSM parameter name"):
        images.check_parameter_name(name)
    assert images.check_parameter_name("/sparknet/ami/latest") == "/sparknet/ami/latest"


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
