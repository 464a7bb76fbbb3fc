"""SSH to nodes over a real sshd on 127.0.0.1 (tests/sshd.py): pinned host keys, refusals of an
unknown or changed host key, and one function on all nodes at once."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import threading
import time

import pytest

from sparknet.cluster import node_endpoints, nodes, openssh, sshkeys
from sparknet.cluster.address import Endpoint
from sparknet.cluster.aws import keys, userdata
from sparknet.cluster.nodes import Access
from sparknet.errors import SparknetError
from tests.cluster.moto_clusters import moto_spec
from tests.sshd import start_sshd

pytestmark = pytest.mark.integration


def test_a_pinned_node_runs_a_command(sshd_nodes):
    group = sshd_nodes(1)
    conn = nodes.connect(group.endpoints[0], group.access, timeout=10)
    try:
        assert conn.run("echo hi", hide=True).stdout == "hi\n"
    finally:
        conn.close()


def test_an_unknown_host_is_refused_in_one_line(sshd_nodes):
    group = sshd_nodes(1, pin=False)
    endpoint = group.endpoints[0]
    with pytest.raises(SparknetError) as caught:
        nodes.connect(endpoint, group.access, timeout=10)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("master (")
    assert f"no host key pinned for [127.0.0.1]:{endpoint.port}" in message
    # nothing was added to the known_hosts behind the user's back (AutoAddPolicy would)
    assert not group.access.known_hosts.exists()


def test_a_changed_host_key_is_refused_in_one_line(sshd_nodes, tmp_path):
    group = sshd_nodes(1)
    endpoint = group.endpoints[0]
    # the pin is another key than the one the node serves: a replaced or impersonated node
    _, other_public = sshkeys.new_ed25519()
    sshkeys.pin(group.access.known_hosts, {endpoint.address: other_public})
    with pytest.raises(SparknetError) as caught:
        nodes.connect(endpoint, group.access, timeout=10)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{endpoint}: its host key changed: it presents ssh-ed25519 ")
    # the key it presents, by its fingerprint as OpenSSH prints it (ssh-keygen -l)
    served = tmp_path / "served.pub"
    served.write_text(group.host_keys[0][1] + "\n")
    keygen = subprocess.run(["ssh-keygen", "-l", "-f", str(served)], capture_output=True,
                            text=True, check=True).stdout.split()[1]  # fmt: skip
    assert keygen.startswith("SHA256:") and not keygen.endswith("=")
    assert f"it presents ssh-ed25519 {keygen}, " in message
    assert f"not the key pinned for {endpoint.address} in {group.access.known_hosts}" in message
    # what it means and what to do; not "pin its new key": the pin comes from the user data
    assert "the machine at that address is not the node" in message
    assert message.endswith(
        "check the node's address; `sparknet cluster down` and `up` replace the node"
    )
    assert "pin its new key" not in message
    # the pin stays what it was
    assert other_public.split()[1] in group.access.known_hosts.read_text()


def test_a_wrong_client_key_is_refused_in_one_line(sshd_nodes, tmp_path):
    group = sshd_nodes(1)
    stranger = tmp_path / "stranger"
    sshkeys.write_private_key(stranger, sshkeys.new_ed25519()[0])
    access = Access(stranger, group.access.known_hosts)
    with pytest.raises(SparknetError, match=r"^master \(.*login refused for key") as caught:
        nodes.connect(group.endpoints[0], access, timeout=10)
    assert str(caught.value).endswith("; check key_file (and key_name on EC2)")


def test_a_node_that_does_not_listen_fails_after_the_timeout(sshd_nodes):
    from tests.sshd import free_port

    group = sshd_nodes(1)
    endpoint = Endpoint("worker-3", "127.0.0.1", free_port(), group.endpoints[0].user)
    start = time.monotonic()
    with pytest.raises(
        SparknetError, match=r"^worker-3 \(.*no SSH connection within 2 s"
    ) as caught:
        nodes.connect(endpoint, group.access, timeout=2)
    # a static host has no security group: EC2's is named as EC2's
    assert str(caught.value).endswith(
        "; check that the node runs and that it lets your address in on its SSH port (on EC2: "
        "its security group)"
    )
    assert 1.5 < time.monotonic() - start < 10


def test_connect_waits_through_a_starting_sshd_that_closes_connections(sshd_nodes):
    """While a fresh node boots, its port may accept and close at once (paramiko: "Error reading
    SSH protocol banner") or close after the banner (an EOFError in the handshake), as when
    cloud-init restarts sshd with the pinned key: both are retried like a refused TCP connection,
    until the real sshd (with the pinned key) answers on that port."""
    group = sshd_nodes(1)
    first = group.servers[0]
    first.stop()
    private, authorized = first.host_key.read_text(), first.authorized_keys.read_text()
    # a port of its own, not the stopped sshd's: another test's connection may take that one
    closer = socket.socket()
    closer.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    closer.bind(("127.0.0.1", 0))
    closer.listen(8)
    endpoint = dataclasses.replace(group.endpoints[0], port=closer.getsockname()[1])
    sshkeys.pin(group.access.known_hosts, {endpoint.address: group.host_keys[0][1]})
    closer.settimeout(0.1)
    kinds: list[str] = []

    def booting() -> None:
        """1.5 s of a port that closes every connection, one at once, the next after the
        banner, and so on; then the node's real sshd on that port."""
        deadline = time.monotonic() + 1.5
        with closer:
            while time.monotonic() < deadline:
                try:
                    client, _ = closer.accept()
                except TimeoutError:
                    continue
                with client:
                    if len(kinds) % 2:
                        client.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
                        client.recv(4096)
                        kinds.append("eof in the handshake")
                    else:
                        kinds.append("no banner")
        group.servers[0] = start_sshd(first.dir, private, authorized, port=endpoint.port)

    thread = threading.Thread(target=booting)
    thread.start()
    try:
        conn = nodes.connect(endpoint, group.access, timeout=20)
    finally:
        thread.join()
    try:
        assert conn.run("echo hi", hide=True).stdout == "hi\n"
    finally:
        conn.close()
    assert {"no banner", "eof in the handshake"} <= set(kinds), kinds


def test_run_all_runs_on_every_node_at_once(sshd_nodes):
    group = sshd_nodes(3)

    def where(endpoint: Endpoint, conn) -> str:
        return conn.run(f"sleep 1; echo {endpoint.name}", hide=True).stdout.strip()

    start = time.monotonic()
    out = nodes.run_all(group.endpoints, group.access, where, timeout=30)
    assert out == {"master": "master", "worker-1": "worker-1", "worker-2": "worker-2"}
    assert time.monotonic() - start < 2.9  # in parallel, not 3 s one after the other


def test_run_all_names_each_failed_node(sshd_nodes):
    group = sshd_nodes(3)
    # worker-2's host key is not the pinned one
    _, other_public = sshkeys.new_ed25519()
    sshkeys.pin(group.access.known_hosts, {group.endpoints[2].address: other_public})

    def step(endpoint: Endpoint, conn) -> str:
        code = 3 if endpoint.name == "worker-1" else 0
        return conn.run(f"echo broken >&2; exit {code}", hide=True).stdout

    with pytest.raises(nodes.NodesFailed) as caught:
        nodes.run_all(group.endpoints, group.access, step, timeout=30)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("2 of 3 nodes failed: ")
    assert "worker-1: `echo broken >&2; exit 3` exited 3: broken" in message
    assert "worker-2 (" in message and "host key changed" in message
    assert "master" not in message
    assert sorted(caught.value.failures) == ["worker-1", "worker-2"]


def test_run_all_times_out_naming_the_busy_node(sshd_nodes):
    group = sshd_nodes(2)

    def step(endpoint: Endpoint, conn) -> None:
        conn.run("sleep 30" if endpoint.name == "worker-1" else "true", hide=True)

    start = time.monotonic()
    with pytest.raises(nodes.NodesFailed, match=r"^1 of 2 nodes failed: worker-1: still running"):
        nodes.run_all(group.endpoints, group.access, step, timeout=3)
    assert time.monotonic() - start < 10


def test_ctrl_c_in_run_all_closes_the_connections_and_ends_the_threads(sshd_nodes):
    """A Ctrl-C while run_all waits (a real SIGINT to this process from a timer thread:
    `_thread.interrupt_main` would not wake the main thread's blocked wait) ends the remote
    commands' threads at once, not when `sleep 30` ends. Under the CLI's handler the
    KeyboardInterrupt is raised in sparknet's code, not inside threading's Condition.wait,
    where it can leave a lock released and turn into "RuntimeError: release unlocked lock"."""
    import os
    import signal
    import threading

    from sparknet.cli.common import Caught, interrupts

    group = sshd_nodes(2)
    started = threading.Barrier(3)

    def step(endpoint: Endpoint, conn) -> None:
        started.wait(timeout=10)
        conn.run("sleep 30", hide=True)

    def interrupt() -> None:
        started.wait(timeout=10)
        time.sleep(0.5)  # both `sleep 30` under way
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    start = time.monotonic()
    with interrupts(Caught()), pytest.raises(KeyboardInterrupt) as raised:
        nodes.run_all(group.endpoints, group.access, step, timeout=60)
    assert time.monotonic() - start < 5  # connect (~1 s) + 0.5 s + the interrupt, not 30 s
    frames = [os.path.basename(entry.path) for entry in raised.traceback]
    assert "threading.py" not in frames, frames
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and ssh_threads():
        time.sleep(0.05)
    assert ssh_threads() == []


def ssh_threads() -> list[str]:
    """The names of run_all's worker threads still alive."""
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("sparknet-ssh")]


def test_the_ssh_command_reaches_a_node_from_a_registry_path_with_a_space(sshd_nodes, tmp_path):
    """OpenSSH splits an -o value on whitespace: the known_hosts path is quoted, so a registry
    under a path with a space still pins (real ssh, real sshd)."""
    import shutil
    import subprocess

    group = sshd_nodes(1)
    spaced = tmp_path / "my registry"
    spaced.mkdir()
    shutil.copy(group.access.known_hosts, spaced / "known_hosts")
    shutil.copy(group.access.key_file, spaced / "id_ed25519")
    access = Access(spaced / "id_ed25519", spaced / "known_hosts")
    argv = openssh.ssh_command(group.endpoints[0], access, "-o", "BatchMode=yes")
    done = subprocess.run([*argv, "echo", "pinned"], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (0, "pinned\n"), done.stderr


# --- a moto cluster's nodes through the seam ----------------------------------------------------

REGION = "us-east-1"
AMI_PARAMETER = "/test/sparknet/nodes-ami"


@pytest.fixture
def spec(moto_endpoint, tmp_path, monkeypatch):
    """A cluster spec on moto with its registry under tmp_path; taken down at the end."""
    with moto_spec(
        moto_endpoint, tmp_path, monkeypatch, prefix="n", ami_parameter=AMI_PARAMETER
    ) as spec:
        yield spec


def _up(spec, endpoint):
    from sparknet.cluster import ec2 as aws_provider

    return aws_provider.up(spec, endpoint_url=endpoint, wait_timeout_s=60, wait_delay_s=0.2)


def _ec2():
    import boto3

    return boto3.client("ec2", region_name=REGION)


def test_up_imports_a_tagged_key_pair_and_pins_each_nodes_host_key(spec, moto_endpoint, moto_nodes):
    import yaml

    from sparknet.cluster import ec2 as aws_provider
    from sparknet.cluster import registry
    from sparknet.cluster.spec import TAG_CLUSTER, TAG_OWNER, TAG_ROLE

    group = moto_nodes(spec.name, spec.workers)
    info = _up(spec, moto_endpoint)
    ec2 = _ec2()
    # the key pair: sparknet's, tagged like the foundation, the private key 0600 here
    pairs = ec2.describe_key_pairs(KeyNames=[f"sparknet-{spec.name}"], IncludePublicKey=True)
    pair = pairs["KeyPairs"][0]
    tags = {t["Key"]: t["Value"] for t in pair["Tags"]}
    assert tags[TAG_CLUSTER] == spec.name and tags[TAG_ROLE] == "foundation"
    assert tags[TAG_OWNER] == "arn:aws:sts::123456789012:user/moto"
    access = sshkeys.access_for(spec)
    assert access.key_file == registry.registry_dir() / spec.name / "id_ed25519"
    assert access.key_file.stat().st_mode & 0o777 == 0o600
    public = access.key_file.with_name("id_ed25519.pub").read_text().split()[:2]
    assert pair["PublicKey"].split()[:2] == public
    # every instance launched with the key pair and a host key of its own launch request
    found = instances_of(ec2, spec.name)
    assert {i["KeyName"] for i in found} == {f"sparknet-{spec.name}"}
    user_data = {i["InstanceId"]: keys.user_data_of(ec2, i["InstanceId"]) for i in found}
    configs = {iid: yaml.safe_load(text) for iid, text in user_data.items()}
    for text, config in zip(user_data.values(), configs.values(), strict=True):
        assert text.startswith("#cloud-config\n")
        assert config["ssh_deletekeys"] is True and "ssh_genkeytypes" not in config
        assert config["write_files"][0]["path"] == userdata.BACKSTOP_SCRIPT  # the backstop
        assert "shutdown -P +60 " in config["write_files"][0]["content"]  # the default hour
    master_key = configs[info.master.id]["ssh_keys"]["ed25519_public"]
    worker_keys = {configs[w.id]["ssh_keys"]["ed25519_public"] for w in info.workers}
    assert len(worker_keys) == 1 and master_key not in worker_keys  # one per launch request
    # pinned under each node's address (the seam's), before anything connected
    pinned = access.known_hosts.read_text().splitlines()
    master_port = group.ports["master"]
    assert f"[127.0.0.1]:{master_port} {master_key}" in pinned
    assert len(pinned) == 3
    # and the pins are the ones the nodes present: every node answers over SSH
    group.serve(ec2)
    endpoints = node_endpoints.endpoints(
        spec.name, aws_provider.status(spec, endpoint_url=moto_endpoint).instances
    )
    names = nodes.run_all(
        endpoints, access, lambda ep, c: c.run("echo $SSH_CONNECTION", hide=True).stdout, 30
    )
    assert sorted(names) == ["master", "worker-1", "worker-2"]

    report = aws_provider.down(spec, endpoint_url=moto_endpoint)
    assert f"key-pair:sparknet-{spec.name}" in report.deleted
    assert not ec2.describe_key_pairs(
        Filters=[{"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]}]
    )["KeyPairs"]
    assert not access.key_file.exists() and not access.known_hosts.exists()


def instances_of(ec2, cluster: str) -> list[dict]:
    from sparknet.cluster.aws.instances import LIVE_STATES
    from sparknet.cluster.spec import TAG_CLUSTER

    filters = [
        {"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]},
        {"Name": "instance-state-name", "Values": list(LIVE_STATES)},
    ]
    return [
        i for r in ec2.describe_instances(Filters=filters)["Reservations"] for i in r["Instances"]
    ]


def test_a_second_up_keeps_the_key_pair_and_the_pins(spec, moto_endpoint, moto_nodes):
    moto_nodes(spec.name, spec.workers)
    _up(spec, moto_endpoint)
    access = sshkeys.access_for(spec)
    key, pins = access.key_file.read_text(), access.known_hosts.read_text()
    pair_id = _ec2().describe_key_pairs(KeyNames=[f"sparknet-{spec.name}"])["KeyPairs"][0]
    _up(spec, moto_endpoint)
    assert access.key_file.read_text() == key and access.known_hosts.read_text() == pins
    again = _ec2().describe_key_pairs(KeyNames=[f"sparknet-{spec.name}"])["KeyPairs"][0]
    assert again["KeyPairId"] == pair_id["KeyPairId"]


def test_a_node_replaced_with_another_host_key_is_refused(spec, moto_endpoint, moto_nodes):
    """The instance behind "master" presents a key other than its user data's (an attacker at
    its address): refused in one line, though sshd there lets the cluster's key in."""
    group = moto_nodes(spec.name, spec.workers)
    spec = spec.model_copy(update={"workers": 0})
    _up(spec, moto_endpoint)
    ec2 = _ec2()
    found = instances_of(ec2, spec.name)
    authorized = sshkeys.access_for(spec).key_file.with_name("id_ed25519.pub").read_text()
    impostor = start_sshd(group.workdir / "impostor", sshkeys.new_ed25519()[0], authorized,
                          port=group.ports["master"])  # fmt: skip
    try:
        from sparknet.cluster.aws import instances

        endpoint = node_endpoints.endpoints(spec.name, [instances.Instance.from_ec2(found[0])])[0]
        with pytest.raises(SparknetError) as caught:
            nodes.connect(endpoint, sshkeys.access_for(spec), timeout=10)
        assert "\n" not in str(caught.value) and "host key changed" in str(caught.value)
    finally:
        impostor.stop()


def test_down_and_sweep_delete_the_key_pair_by_its_tag_with_the_registry_lost(
    spec, moto_endpoint, tmp_path
):
    import shutil

    from sparknet.cluster import inventory, registry
    from sparknet.cluster.aws import instances

    _up(spec, moto_endpoint)
    ec2 = instances.ec2_client(REGION, moto_endpoint)
    instances.terminate_cluster(ec2, spec.name, delay_s=0.2)
    shutil.rmtree(registry.registry_dir())
    found = inventory.orphans(REGION, set(), endpoint_url=moto_endpoint)
    assert f"key-pair:sparknet-{spec.name}" in found[spec.name].items
    swept = cli("sweep", "--region", REGION, "--yes", cwd=tmp_path)
    assert swept.returncode == 0, swept.stderr
    assert f"deleted key-pair:sparknet-{spec.name}" in swept.stdout
    assert not ec2.describe_key_pairs(
        Filters=[{"Name": "key-name", "Values": [f"sparknet-{spec.name}"]}]
    )["KeyPairs"]


def cli(*args: str, cwd):
    import os
    import subprocess

    from tests.conftest import SPARKNET

    return subprocess.run(
        [str(SPARKNET), "cluster", *args], cwd=cwd, env=os.environ.copy(),
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def test_cli_ssh_runs_a_command_on_a_node_over_the_pinned_key(
    spec, moto_endpoint, moto_nodes, tmp_path
):
    group = moto_nodes(spec.name, spec.workers)
    _up(spec, moto_endpoint)
    group.serve(_ec2())

    done = cli("ssh", spec.name, "--", "echo", "hi", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, "hi\n"), done.stderr
    on_worker = cli("ssh", spec.name, "worker-2", "--", "echo $SSH_CONNECTION", cwd=tmp_path)
    assert on_worker.returncode == 0, on_worker.stderr
    assert on_worker.stdout.split()[-1] == str(group.ports["worker-2"])
    # the command's exit code is the exit code
    failed = cli("ssh", spec.name, "worker-1", "--", "exit 7", cwd=tmp_path)
    assert failed.returncode == 7


def test_cli_ssh_to_an_unknown_node_is_one_line_exit_2(spec, moto_endpoint, moto_nodes, tmp_path):
    moto_nodes(spec.name, spec.workers)
    _up(spec, moto_endpoint)
    for node in ("worker-9", "mastr"):
        done = cli("ssh", spec.name, node, "--", "true", cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(f"error: no node '{node}'")
        assert done.stderr.count("\n") == 1 and "master, worker-1, worker-2" in done.stderr


def test_cli_ssh_takes_its_options_after_the_name(moto_endpoint, tmp_path, monkeypatch):
    """`cluster ssh NAME --region R` (options after NAME, before `--`) is read as the option:
    the cluster is looked for in R (and --debug shows the traceback); an unknown option there
    is one line naming the options."""
    from sparknet.cluster import registry

    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    config = tmp_path / "sparknet.yaml"
    config.write_text("clusters: {}\n")
    done = cli("ssh", "nosuch", "--region", "eu-west-3", f"--config={config}", "--debug",
               "--endpoint-url", moto_endpoint, "--", "true", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "cluster nosuch has no running instances in eu-west-3;" in done.stderr
    assert "Traceback" in done.stderr  # --debug was read too
    bad = cli("ssh", "nosuch", "worker-1", "--regoin", "eu-west-3", cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: no option --regoin of `cluster ssh` (")
    assert bad.stderr.count("\n") == 1 and "--region" in bad.stderr


def test_cli_up_refuses_a_secret_others_can_read_before_launching(spec, tmp_path):
    """The bootstrap's secret (and wheel) are ready before `up` launches anything: a Spark
    secret others can read is one line and no instance was ever launched (nor billed)."""
    import yaml

    from sparknet.cluster import registry
    from sparknet.cluster.spec import TAG_CLUSTER

    secret = registry.secret_file(spec.name)
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_text("ab" * 32 + "\n")
    secret.chmod(0o644)
    entry = {"region": REGION, "ami_parameter": AMI_PARAMETER, "workers": 0,
             "master_type": "g5.xlarge", "allowed_cidr": "203.0.113.9/32"}  # fmt: skip
    (tmp_path / "sparknet.yaml").write_text(yaml.safe_dump({"clusters": {spec.name: entry}}))
    done = cli("up", spec.name, cwd=tmp_path)
    assert done.returncode == 2, done.stderr  # bad input: the user's file to fix
    assert done.stderr == (
        f"error: {secret} (the cluster's Spark secret) is readable by others: chmod 600 {secret}\n"
    )
    found = _ec2().describe_instances(
        Filters=[{"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]}]
    )["Reservations"]
    assert found == []
    # nothing else was written: the registry dir holds the user's secret only, no lock file
    assert sorted(p.name for p in registry.registry_dir().rglob("*") if p.is_file()) == [
        "spark-secret"
    ]


def test_cli_ssh_refuses_a_changed_host_key(spec, moto_endpoint, moto_nodes, tmp_path):
    group = moto_nodes(spec.name, spec.workers)
    spec = spec.model_copy(update={"workers": 0})
    _up(spec, moto_endpoint)
    authorized = sshkeys.access_for(spec).key_file.with_name("id_ed25519.pub").read_text()
    impostor = start_sshd(group.workdir / "impostor", sshkeys.new_ed25519()[0], authorized,
                          port=group.ports["master"])  # fmt: skip
    try:
        done = cli("ssh", spec.name, "--", "echo", "hi", cwd=tmp_path)
    finally:
        impostor.stop()
    assert done.returncode == 255 and "hi" not in done.stdout
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in done.stderr


def test_cli_status_shows_each_nodes_address_and_ssh_command(
    spec, moto_endpoint, moto_nodes, tmp_path
):
    import shlex

    group = moto_nodes(spec.name, spec.workers)
    _up(spec, moto_endpoint)
    group.serve(_ec2())
    shown = cli("status", spec.name, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    lines = {
        ln.split("\t")[0]: ln.split("\t")
        for ln in shown.stdout.splitlines()
        if ln.startswith("ssh ")
    }
    assert sorted(lines) == ["ssh master", "ssh worker-1", "ssh worker-2"]
    rows = [ln.split("\t") for ln in shown.stdout.splitlines() if "\ti-" in ln]
    assert sorted((row[0], row[-1]) for row in rows) == [
        ("master", "master"),
        ("worker", "worker-1"),
        ("worker", "worker-2"),
    ]
    _, address, command = lines["ssh worker-1"]
    assert address.endswith(f"@127.0.0.1:{group.ports['worker-1']}")
    # the printed command works as it is
    import subprocess

    ran = subprocess.run(
        [*shlex.split(command), "echo", "ok"], capture_output=True, text=True, timeout=30
    )
    assert (ran.returncode, ran.stdout) == (0, "ok\n"), ran.stderr


def test_the_users_own_key_pair_is_used_and_never_deleted(
    spec, moto_endpoint, moto_nodes, tmp_path
):
    from sparknet.cluster import ec2 as aws_provider

    group = moto_nodes(spec.name, 0)
    ec2 = _ec2()
    private, public = sshkeys.new_ed25519()
    key_file = tmp_path / "mine"
    sshkeys.write_private_key(key_file, private)
    name = f"mine-{spec.name}"
    ec2.import_key_pair(KeyName=name, PublicKeyMaterial=public.encode())
    spec = spec.model_copy(update={"workers": 0, "key_name": name, "key_file": str(key_file)})

    key_file.chmod(0o644)
    with pytest.raises(SparknetError, match="readable by others"):
        _up(spec, moto_endpoint)
    assert not instances_of(ec2, spec.name)  # refused before anything was made
    key_file.chmod(0o600)

    _up(spec, moto_endpoint)
    assert {i["KeyName"] for i in instances_of(ec2, spec.name)} == {name}
    assert not ec2.describe_key_pairs(
        Filters=[{"Name": "key-name", "Values": [f"sparknet-{spec.name}"]}]
    )["KeyPairs"]
    group.serve(ec2)
    conn = nodes.connect(group_endpoint(spec, moto_endpoint), sshkeys.access_for(spec), 10)
    try:
        assert conn.run("echo mine", hide=True).stdout == "mine\n"
    finally:
        conn.close()
    aws_provider.down(spec, endpoint_url=moto_endpoint)
    assert ec2.describe_key_pairs(KeyNames=[name])["KeyPairs"]  # the user's: kept
    assert key_file.is_file()


def group_endpoint(spec, moto_endpoint) -> Endpoint:
    from sparknet.cluster import ec2 as aws_provider

    return node_endpoints.endpoints(
        spec.name, aws_provider.status(spec, endpoint_url=moto_endpoint).instances
    )[0]


def test_cli_tunnel_forwards_the_master_uis_to_local_ports(
    spec, moto_endpoint, moto_nodes, tmp_path
):
    """The loopback node is this machine: the UIs are two HTTP servers here, on free ports (a
    test run may hold 8080 and 4040) named by --remote-*-port."""
    import http.server
    import os
    import signal
    import subprocess
    import threading
    import urllib.request

    from tests.conftest import SPARKNET
    from tests.sshd import free_port

    servers = []
    remote_master, remote_app = free_port(), free_port()
    for port, body in ((remote_master, b"master ui"), (remote_app, b"app ui")):

        class Answer(http.server.BaseHTTPRequestHandler):
            text = body

            def do_GET(self):
                self.send_response(200)
                self.end_headers()
                self.wfile.write(self.text)

            def log_message(self, *args):
                pass

        servers.append(http.server.HTTPServer(("127.0.0.1", port), Answer))
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    group = moto_nodes(spec.name, 0)
    spec = spec.model_copy(update={"workers": 0})
    _up(spec, moto_endpoint)
    group.serve(_ec2())
    local_master, local_app = free_port(), free_port()
    proc = subprocess.Popen(
        [str(SPARKNET), "cluster", "tunnel", spec.name, "--master-ui-port", str(local_master),
         "--app-ui-port", str(local_app), "--remote-master-ui-port", str(remote_master),
         "--remote-app-ui-port", str(remote_app)],
        cwd=tmp_path, env=os.environ.copy(), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        got = {}
        for _ in range(100):
            try:
                for port in (local_master, local_app):
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as r:
                        got[port] = r.read()
                break
            except OSError:
                if proc.poll() is not None:
                    break
                time.sleep(0.1)
        assert got == {local_master: b"master ui", local_app: b"app ui"}, proc.poll()
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
        for server in servers:
            server.shutdown()
            server.server_close()
    assert f"http://localhost:{local_master}" in err and f"http://localhost:{local_app}" in err


def test_a_failed_up_removes_the_key_pair_and_key_it_made(spec, moto_endpoint, monkeypatch):
    """The workers' launch fails (a stub on the real client: moto never fails a launch): the
    key pair this `up` imported goes with everything else it made, and so does the local key."""
    from botocore.exceptions import ClientError

    from sparknet.cluster.aws import instances
    from sparknet.cluster.spec import TAG_CLUSTER

    real = instances.ec2_client
    calls = []

    def failing_client(*args, **kwargs):
        ec2 = real(*args, **kwargs)
        run = ec2.run_instances

        def run_instances(**params):
            calls.append(params)
            if len(calls) > 1:
                error = {"Code": "InternalError", "Message": "injected"}
                raise ClientError({"Error": error}, "RunInstances")
            return run(**params)

        ec2.run_instances = run_instances
        return ec2

    monkeypatch.setattr(instances, "ec2_client", failing_client)
    with pytest.raises(SparknetError, match="injected"):
        _up(spec, moto_endpoint)
    assert calls[0]["KeyName"] == f"sparknet-{spec.name}"
    assert calls[0]["UserData"] != calls[1]["UserData"]  # the master's host key is its own
    tagged = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]}]
    assert not _ec2().describe_key_pairs(Filters=tagged)["KeyPairs"]
    assert not sshkeys.access_for(spec).key_file.exists()


def test_nodes_served_while_up_runs_answer_at_once(spec, moto_endpoint, moto_nodes):
    """`MotoNodes.watch` starts each node's sshd as its instance appears on moto, so a command
    that launches and connects in one go (`up` with its bootstrap) finds the nodes there."""
    group = moto_nodes(spec.name, spec.workers)
    with group.watch(_ec2()):
        info = _up(spec, moto_endpoint)
        out = nodes.run_all(
            node_endpoints.endpoints(spec.name, info.instances), sshkeys.access_for(spec),
            lambda ep, c: c.run("true", hide=True).exited, timeout=30,
        )  # fmt: skip
    assert out == {"master": 0, "worker-1": 0, "worker-2": 0}
