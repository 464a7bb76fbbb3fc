"""The install and configuration steps of a node, each with `check` (already done?) and `apply`.

The node's Python against what it must run (before anything installs), the prefix's
directories, Java and the OS packages, the NVIDIA driver (only where a GPU node's `nvidia-smi`
fails), a venv with torch (over an existing env whose torch fits), the submitter's pyspark, the
sparknet wheel (which must then start), and `spark-defaults.conf` with the cluster's secret."""

from __future__ import annotations

import hashlib
import re

import fabric

from sparknet.cluster import nodes
from sparknet.cluster.remote import (
    CommandFailed,
    Conn,
    ConnectionLost,
    q,
    run,
    run_script,
    succeeds,
    upload,
)
from sparknet.cluster.spark.plan import (
    JOBS_DIR,
    PIP_NETWORK,
    Context,
    Node,
    python_problem,
    python_version,
)
from sparknet.cluster.spark.spark_conf import (
    GPU_DISCOVERY_SCRIPT,
    TORCH_MIN,
    java_major,
    spark_defaults,
)
from sparknet.errors import SparknetError
from sparknet.node.command import node_command

# --- steps ---------------------------------------------------------------------------------------


class Step:
    """One idempotent piece of a bootstrap. `check` says whether it is done already (and must
    say yes right after `apply`); `apply` does it. `timeout` bounds each of its commands."""

    name = "step"
    timeout: float = 120

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def check(self, conn: Conn) -> bool:
        raise NotImplementedError

    def apply(self, conn: Conn) -> None:
        raise NotImplementedError

    def run(self, conn: Conn, command: str, timeout: float | None = None) -> str:
        return run(conn, command, timeout or self.timeout)

    def script(
        self,
        conn: Conn,
        name: str,
        *args: str,
        timeout: float | None = None,
        python: str | None = None,
    ) -> str:
        """The package's script `name` run on the node (`remote.run_script`; a Python one by
        `python`): a step that runs before the wheel is there."""
        return run_script(conn, name, *args, timeout=timeout or self.timeout, python=python)


#: what a node whose Python cannot run its pyspark or sparknet is told to do
PYTHON_FIX = (
    "launch the nodes from an image whose python3 fits (the default, the Ubuntu 24.04 Deep "
    "Learning Base AMI, has 3.12) or set bootstrap: python_env to an env on the nodes with one "
    f"and torch {'.'.join(map(str, TORCH_MIN))}+"
)


class NodePython(Step):
    """The Python the node's venv is made from runs what the node installs
    (`Plan.python_needs`: its pyspark and sparknet): the one `PythonEnv` will use, the plan's
    env, else an AMI env whose torch is new enough (`Context.base_env`), else `python3`. Checked
    first, before anything is installed: a node whose Python is too old fails in one line naming
    its Python, what is needed, and why that Python (the AMI envs passed over for their torch),
    not in pip's words after the multi-GB torch download."""

    name = "python"

    def problem(self, conn: Conn) -> str | None:
        ctx, base = self.ctx, self.ctx.base_env
        needs = ctx.plan.python_needs()
        if base is None:
            problem = python_problem("python3", ctx.facts.python, needs)
            passed = ctx.passed_over
            if problem is None or not passed:
                return problem
            why = "; ".join(
                f"the image's env {e.path} has "
                f"{f'torch {e.torch}' if e.torch else 'no torch'} (sparknet needs {TORCH_FLOOR}+)"
                for e in passed
            )
            return f"{why}, so the venv is made from python3, and {problem}"
        found = next((e for e in ctx.facts.envs if e.path.rstrip("/") == base), None)
        python = f"{base}/bin/python"
        if found is not None:  # an AMI env: the facts command read its Python
            return python_problem(python, found.python, needs)
        try:
            version = python_version(self.run(conn, f"{q(python)} --version 2>&1"))
        except CommandFailed:
            version = None
        return python_problem(python, version, needs)

    def check(self, conn: Conn) -> bool:
        return self.problem(conn) is None

    def apply(self, conn: Conn) -> None:
        raise CommandFailed(f"{self.problem(conn)}: {PYTHON_FIX}", [])


#: the prefix's dirs only the node's user may enter (0700): the secret (conf), the daemons'
#: logs (logs), the executors' stderr and files (work), the jobs' settings and driver logs
#: (jobs); Spark's local dirs (cached blocks, shuffle files) too
PRIVATE_DIRS = ("conf", "logs", "work", JOBS_DIR)


class Dirs(Step):
    """The prefix's tree, owned by the node's user; conf/, logs/, work/, jobs/ and Spark's local
    dirs only for that user."""

    name = "dirs"

    @property
    def dirs(self) -> list[str]:
        n = self.ctx.node
        subdirs = (n.path(d) for d in ("conf", "logs", "run", "work", "dist", JOBS_DIR))
        return [n.prefix, *subdirs, *self.ctx.local_dirs]

    @property
    def private(self) -> list[str]:
        return [*(self.ctx.node.path(d) for d in PRIVATE_DIRS), *self.ctx.local_dirs]

    def check(self, conn: Conn) -> bool:
        tests = " && ".join(f"[ -d {q(d)} ] && [ -w {q(d)} ]" for d in self.dirs)
        modes = " && ".join(f'[ "$(stat -c %a {q(d)})" = 700 ]' for d in self.private)
        return succeeds(conn, f"{tests} && {modes}")

    def apply(self, conn: Conn) -> None:
        s, user = self.ctx.sudo, self.ctx.facts.user
        self.run(
            conn,
            f"{s}mkdir -p {q(*self.dirs)} && {s}chown {q(user)} {q(*self.dirs)}"
            f" && chmod 700 {q(*self.private)}",
        )


#: the package's script that installs OS packages with apt (before the node has a venv)
APT_INSTALL = "apt_install.sh"


class OsPackages(Step):
    """Java 17+ for Spark (and python3-venv, curl): skipped where `java -version` says 17+."""

    name = "java"
    timeout = 900
    PACKAGES = ("openjdk-17-jre-headless", "python3-venv", "curl")

    def check(self, conn: Conn) -> bool:
        try:
            text = self.run(conn, "java -version 2>&1")
        except CommandFailed:
            return False
        major = java_major(text)
        if major is None or major < 17:
            return False
        return bool(self.ctx.base_env) or succeeds(conn, "python3 -c 'import ensurepip'")

    def apply(self, conn: Conn) -> None:
        self.script(conn, APT_INSTALL, *self.PACKAGES)


#: what prints the node's boot id, new at every boot: how a reboot is told from a node that
#: still answers from before it
BOOT_ID = "cat /proc/sys/kernel/random/boot_id"
#: how long the nvidia-driver step waits for a node it rebooted to answer over SSH again
REBOOT_WAIT_S = 600.0
#: seconds that replace REBOOT_WAIT_S (a test's node that never comes back fails in seconds)
REBOOT_WAIT_ENV = "SPARKNET_REBOOT_WAIT_S"


def reboot_wait_s() -> float:
    """REBOOT_WAIT_S, or the seconds `REBOOT_WAIT_ENV` gives (`nodes.seconds_setting`)."""
    return nodes.seconds_setting(REBOOT_WAIT_ENV, REBOOT_WAIT_S)


#: the node's PCI devices in sysfs, where NVSwitches show before any driver loads: NVIDIA's
#: (vendor 0x10de) devices of class 0x0680 ("Bridge"), six on HGX A100 (p4d, p4de), four on
#: HGX H100/H200 (p5, p5e, p5en); NVIDIA's fabric manager guide lists them so
PCI_DEVICES = "/sys/bus/pci/devices"
#: the systemd service of `nvidia-fabricmanager-<major>`: on an NVSwitch node CUDA sees no GPU
#: (cudaErrorSystemNotReady) until it has set the switches up, while nvidia-smi lists them all
FABRIC_MANAGER = "nvidia-fabricmanager"
#: the NVIDIA driver packages dpkg knows on the node, with their state (`ii`: installed)
DRIVER_PACKAGES = "dpkg-query -W -f='${db:Status-Abbrev} ${Package}\\n' 'nvidia-headless-no-dkms-*'"


#: the package's script that exits 0 where a PCI tree has an NVSwitch
NVSWITCHES = "nvswitches.sh"


def driver_branches(listed: str) -> set[str]:
    """The driver branches (`550-server`) of the installed headless packages in DRIVER_PACKAGES'
    output. `ubuntu-drivers install --gpgpu` installs `nvidia-headless-no-dkms-<branch>` and the
    kernel modules only, not `nvidia-utils-<branch>` (nvidia-smi); the open kernel modules'
    variant (`-open`) shares the branch's utils and fabric manager."""
    package = r"^ii\s+nvidia-headless-no-dkms-(\d+(?:-server)?)(?:-open)?\s*$"
    return set(re.findall(package, listed, re.M))


class NvidiaDriver(Step):
    """The NVIDIA driver with its `nvidia-smi` (the step's check and Spark's GPU discovery run
    it), only on a node with GPUs whose `nvidia-smi` fails (the Deep Learning AMIs have it); on
    a node with NVSwitches also NVIDIA's fabric manager, running. A fresh driver loads at the
    next boot: the step reboots the node, waits for it to answer again with its pinned host key
    (up to `reboot_wait_s`), and checks `nvidia-smi` there; the bootstrap goes on over the new
    connection.

    The NVSwitches are found on the node (its PCI tree), not from the instance type: that works
    for every image and launch path, and needs no list of types that grows with each new one."""

    name = "nvidia-driver"
    timeout = 1800

    def check(self, conn: Conn) -> bool:
        if self.ctx.node.gpus == 0:
            return True
        if not succeeds(conn, "nvidia-smi -L >/dev/null"):
            return False
        return not self._nvswitches(conn) or succeeds(
            conn, f"systemctl is-active --quiet {FABRIC_MANAGER}"
        )

    def _nvswitches(self, conn: Conn) -> bool:
        """Whether the node has NVSwitches (the package's NVSWITCHES, on PCI_DEVICES)."""
        try:
            self.script(conn, NVSWITCHES, PCI_DEVICES, timeout=60)
        except ConnectionLost:
            raise
        except CommandFailed:
            return False
        return True

    def apply(self, conn: Conn) -> None:
        if not self.ctx.plan.install_drivers:
            raise CommandFailed(
                f"the node should offer {self.ctx.node.gpus} GPUs but `nvidia-smi -L` fails "
                f"(or the node has NVSwitches and its {FABRIC_MANAGER} service does not run); "
                "sparknet installs no driver on a machine of yours: install the NVIDIA driver "
                "there, or set bootstrap: gpus_per_node: 0",
                [],
            )
        fabric = self._nvswitches(conn)
        if succeeds(conn, "nvidia-smi -L"):  # a working driver (an AMI's) is left as it is
            if fabric:
                self._fabric_manager_runs(conn, f"{FABRIC_MANAGER}-<the driver's branch>")
            return
        s = self.ctx.sudo
        self.script(conn, APT_INSTALL, "ubuntu-drivers-common")
        self.run(conn, f"{s}ubuntu-drivers install --gpgpu")
        branch = self._branch(conn)
        packages = [f"nvidia-utils-{branch}"]
        if fabric:  # enabled now, it starts at the boot that loads the driver
            packages.append(f"nvidia-fabricmanager-{branch.split('-')[0]}")
        self.script(conn, APT_INSTALL, "--no-update", *packages)
        if fabric:
            self.run(conn, f"{s}systemctl enable {FABRIC_MANAGER}")
        if not succeeds(conn, "nvidia-smi -L"):  # else loaded without a reboot
            self.reboot(conn)
            self._loaded(conn)
        if fabric:
            self._fabric_manager_runs(conn, packages[-1])

    def _branch(self, conn: Conn) -> str:
        """The driver branch ubuntu-drivers installed (`driver_branches`)."""
        try:
            listed = self.run(conn, DRIVER_PACKAGES)
        except CommandFailed:  # dpkg-query exits 1 where no package matches
            listed = ""
        branches = sorted(driver_branches(listed))
        if len(branches) != 1:
            found = ", ".join(branches) or "none"
            raise CommandFailed(
                "after `ubuntu-drivers install --gpgpu` the node should have one "
                f"nvidia-headless-no-dkms-<branch> package installed, it has {found}: install "
                "the NVIDIA driver and its nvidia-utils on the image, or launch the node from "
                "the Deep Learning AMI",
                [],
            )
        return branches[0]

    def _loaded(self, conn: Conn) -> None:
        """Check `nvidia-smi` after the reboot; a CommandFailed says why it fails."""
        try:
            self.run(conn, "nvidia-smi -L")
        except ConnectionLost as exc:  # not the driver's fault: the node went away again
            raise CommandFailed(
                f"the node rebooted to load the NVIDIA driver and answered, then its SSH "
                f"connection was lost before nvidia-smi could be checked ({exc.what}); run the "
                "bootstrap again once it answers",
                exc.tail,
            ) from None
        except CommandFailed as exc:
            raise CommandFailed(
                "installed the NVIDIA driver and rebooted, but nvidia-smi still fails: the "
                "driver does not load on this node (its `dmesg` says why); launch it from an "
                "image with the driver (the Deep Learning AMI)",
                exc.tail,
            ) from None

    def _fabric_manager_runs(self, conn: Conn, package: str) -> None:
        """Start the fabric manager (`package`'s): at once where the boot started it already,
        after its start-up where it is still starting."""
        try:
            self.run(conn, f"{self.ctx.sudo}systemctl start {FABRIC_MANAGER}", timeout=300)
        except ConnectionLost:
            raise
        except CommandFailed as exc:
            raise CommandFailed(
                f"the node has NVSwitches, and NVIDIA's fabric manager ({package}) does not "
                f"start ({exc.what}): CUDA sees no GPU without it; `journalctl -u "
                f"{FABRIC_MANAGER}` on the node says why",
                exc.tail,
            ) from None

    def reboot(self, conn: Conn) -> None:
        """Reboot the node and give `conn` a connection to it once it is back (`nodes.
        reconnect_after_restart`): a new boot id, the same pinned host key."""
        access = self.ctx.access
        if access is None or not isinstance(conn, fabric.Connection):
            raise CommandFailed(
                "installed the NVIDIA driver, but nvidia-smi fails until the node reboots: "
                "reboot it, then run the bootstrap again",
                [],
            )
        wait = reboot_wait_s()
        before = self.run(conn, BOOT_ID, timeout=60).strip()
        s = self.ctx.sudo
        command = f"{s}systemctl reboot" if self.ctx.facts.systemd else f"{s}shutdown -r now"
        try:
            self.run(conn, command, timeout=60)
        except CommandFailed as exc:
            # the node going down under it counts as sent: the connection dropped (no exit
            # status came) or no answer in time; an exit code over a live connection does not
            refused = exc.what.startswith("exited ") and exc.what != "exited -1"
            if refused and conn.is_connected:
                raise CommandFailed(
                    f"`{command}` {exc.what}: the node did not reboot to load the NVIDIA driver",
                    exc.tail,
                ) from None

        def restarted(fresh: fabric.Connection) -> bool:
            try:
                return run(fresh, BOOT_ID, timeout=60).strip() not in ("", before)
            except ConnectionLost:
                raise  # the old sshd going down under it: not back yet
            except CommandFailed as exc:  # it answers: say so, and what failed
                last = f": {exc.tail[-1].strip()}" if exc.tail else ""
                raise CommandFailed(
                    f"it answers, but `{BOOT_ID}` {exc.what}{last}", exc.tail
                ) from None

        try:
            nodes.reconnect_after_restart(conn, self.ctx.node.endpoint, access, wait, restarted)
        except nodes.NotBack as exc:
            raise CommandFailed(
                f"told to reboot to load the NVIDIA driver, the node was not back over SSH "
                f"within {wait:g} s ({exc.why}); see its state and system log in the EC2 console, "
                "then run the bootstrap again once it answers (or set "
                f"{REBOOT_WAIT_ENV} to wait longer)",
                [],
            ) from None


#: the .pth file that lets the node's venv see an existing env's packages (torch, CUDA)
BASE_PTH = "_sparknet_base.pth"

#: "2.8": the oldest torch the nodes run (`spark_conf.TORCH_MIN`)
TORCH_FLOOR = ".".join(map(str, TORCH_MIN))
#: the package's script that fails, saying why, unless an env's torch fits the node (run by
#: that env's Python, before the wheel is on the node)
TORCH_FITS = "torch_fits.py"


class PythonEnv(Step):
    """The node's venv (`prefix`/venv) with a torch that imports (and sees the GPUs on a GPU
    node). Over an existing env whose torch fits (`Plan.python_env`, else the AMI's PyTorch env):
    a venv without packages of its own that sees that env's through a .pth file, so sparknet and
    its pyspark never change the AMI's env. Else (or when the AMI's torch does not fit) a venv of
    its own with torch from PyTorch's index for the driver's CUDA version."""

    name = "python-env"
    timeout = 1800

    def _torch_fits(
        self, conn: Conn, python: str, quick: bool = False, timeout: float | None = None
    ) -> None:
        """CommandFailed, its last line saying why, unless `python`'s torch fits the node
        (the package's TORCH_FITS): torch TORCH_MIN or newer (from its metadata), and on a GPU
        node one that sees the GPUs. `quick` on a node without GPUs only reads the version
        (importing torch takes seconds on every check; `apply` imports it)."""
        flags = [*(["--quick"] if quick else []), *(["--gpus"] if self.ctx.node.gpus else [])]
        self.script(conn, TORCH_FITS, TORCH_FLOOR, *flags, timeout=timeout, python=python)

    def check(self, conn: Conn) -> bool:
        """A venv of its own, or one laid over today's base env, whose torch fits."""
        n, base = self.ctx.node, self.ctx.base_env
        made = f"[ -x {q(n.path('venv', 'bin', 'pip'))} ]"
        if base:
            line = q(self._base_line(conn, base))
            made = f"{{ {made} || grep -qxF {line} {self._site(n.python)}/{BASE_PTH}; }}"
        if not succeeds(conn, made, timeout=120):
            return False
        try:
            self._torch_fits(conn, n.python, quick=True, timeout=120)
        except ConnectionLost:
            raise
        except CommandFailed:
            return False
        return True

    @staticmethod
    def _site(python: str) -> str:
        return f"$({q(python)} -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')"

    def _base_line(self, conn: Conn, base: str) -> str:
        """The .pth line that adds `base`'s site-packages (and runs its .pth files)."""
        site = self.run(conn, f"echo {self._site(base + '/bin/python')}").strip()
        return f"import site; site.addsitedir({site!r})"

    def apply(self, conn: Conn) -> None:
        n, base = self.ctx.node, self.ctx.base_env
        if base:
            python = f"{base}/bin/python"
            try:
                self._torch_fits(conn, python, timeout=120)
            except CommandFailed as exc:
                if self.ctx.plan.python_env:  # asked for, so not silently replaced
                    raise CommandFailed(  # the runner adds the last line: why it does not fit
                        f"{base} has no torch that fits this node: give bootstrap: python_env "
                        f"an env with torch {TORCH_FLOOR}+, or leave it unset for a fresh venv "
                        "with one",
                        exc.tail,
                    ) from None
            else:
                line = self._base_line(conn, base)
                self.run(
                    conn,
                    f"rm -rf {q(n.venv)} && {q(python)} -m venv --without-pip {q(n.venv)}"
                    f" && echo {q(line)} > {self._site(n.python)}/{BASE_PTH}",
                )
                return
        # the AMI's env (if any) does not fit: a venv of python3's own, which must fit too
        problem = python_problem("python3", self.ctx.facts.python, self.ctx.plan.python_needs())
        if problem:
            raise CommandFailed(f"{problem}: {PYTHON_FIX}", [])
        try:
            index = self.ctx.index_flags(self._driver_cuda(conn) if n.gpus else None, torch=True)
        except SparknetError as exc:  # a driver too old for every torch that fits
            raise CommandFailed(str(exc), []) from None
        install = f"{q(n.python)} -m pip install -q --disable-pip-version-check {PIP_NETWORK}"
        self.run(
            conn,
            f"rm -rf {q(n.venv)} && python3 -m venv {q(n.venv)}"
            f" && {f'{install} {index}'.rstrip()} {q(f'torch>={TORCH_FLOOR}')} torchvision",
        )
        self._torch_fits(conn, n.python)

    def _driver_cuda(self, conn: Conn) -> str | None:
        """The highest CUDA version the driver runs, as `nvidia-smi` prints it."""
        match = re.search(r"CUDA Version:\s*([\d.]+)", self.run(conn, "nvidia-smi"))
        return match.group(1) if match else None


class Pyspark(Step):
    """The submitter's pyspark version in the node's venv (its own copy over a base env with
    another version): driver and executors must run one Spark."""

    name = "pyspark"
    timeout = 900

    def check(self, conn: Conn) -> bool:
        code = "import importlib.metadata as m; print(m.version('pyspark'))"
        try:
            have = self.run(conn, f"{q(self.ctx.node.python)} -c {q(code)}").strip()
        except CommandFailed:
            return False
        return have == self.ctx.plan.pyspark_version

    def apply(self, conn: Conn) -> None:
        version = self.ctx.plan.pyspark_version
        self.run(conn, f"{self.ctx.pip_install(conn)} {q('pyspark==' + version)}")


#: the file in the node's venv that records the digest of the sparknet wheel installed there
WHEEL_MARK = "sparknet-wheel.sha256"


class SparknetWheel(Step):
    """The sparknet wheel built from the submitter's checkout, so the nodes run exactly the
    submitter's code. Done when the venv's sparknet has the wheel's version and the recorded
    digest is the wheel's."""

    name = "sparknet"
    timeout = 900

    @property
    def starts(self) -> str:
        """The command that fails unless the venv's `sparknet` starts (its CLI imports):
        installed is not enough, a dependency missing from the wheel fails only here."""
        return f"{q(self.ctx.node.path('venv', 'bin', 'sparknet'))} --help >/dev/null"

    def check(self, conn: Conn) -> bool:
        n, wheel = self.ctx.node, self.ctx.plan.wheel
        code = (
            "import importlib.metadata as m, importlib.util as u, sys; "
            "print(m.version('sparknet'), u.find_spec('sparknet').origin.startswith(sys.prefix))"
        )
        mark = q(n.path("venv", WHEEL_MARK))
        try:
            out = self.run(
                conn, f"{q(n.python)} -c {q(code)} && cat {mark} && {self.starts}", timeout=60
            )
        except CommandFailed:
            return False
        return out.split() == [wheel.version, "True", wheel.digest]

    def apply(self, conn: Conn) -> None:
        n, wheel = self.ctx.node, self.ctx.plan.wheel
        remote = n.path("dist", wheel.path.name)
        upload(conn, wheel.path.read_bytes(), remote, 0o644)
        pip = self.ctx.pip_install(conn)
        self.run(conn, f"{pip} --no-deps --force-reinstall {q(remote)}")
        # sparknet's dependencies: already there over the AMI's env or the test venv; a node
        # that lacks some gets them from the index (pip leaves satisfied ones alone)
        if not succeeds(conn, node_command(n.python, "dependencies"), timeout=120):
            self.run(conn, f"{pip} {q(remote)}")
        try:
            self.run(conn, self.starts, timeout=120)
        except CommandFailed as exc:
            raise CommandFailed(
                f"the installed sparknet does not start (`sparknet --help` {exc.what})", exc.tail
            ) from None
        self.run(conn, f"echo {q(wheel.digest)} > {q(n.path('venv', WHEEL_MARK))}")


def sha256_hex(text: str) -> str:
    """The SHA-256 of `text` (UTF-8) in hex: what stamps and conf checks compare."""
    return hashlib.sha256(text.encode()).hexdigest()


def conf_files(ctx: Context) -> dict[str, tuple[str, int]]:
    """The files of the node's conf dir: name -> (text, mode)."""
    n = ctx.node
    script = n.path("conf", "gpus.sh")
    files = {
        "spark-defaults.conf": (
            spark_defaults(ctx.plan.secret, n.python, n.gpus, script if n.gpus else None),
            0o600,
        )
    }
    if n.gpus:
        files["gpus.sh"] = (GPU_DISCOVERY_SCRIPT, 0o700)
    return files


#: the .pth file in the node's venv that points Spark at the node's conf dir
CONF_PTH = "_sparknet_spark_conf.pth"


def conf_pth(node: Node, region: str | None = None) -> str:
    """A .pth line that gives every Python of the node's venv SPARK_CONF_DIR (unless set), so a
    driver started there (`sparknet train --master spark://...` on the master) reads the
    cluster's spark-defaults.conf, and with it the secret, with nothing on its command line.
    With `region` (an EC2 cluster's), AWS_DEFAULT_REGION too, unless set: the driver's and
    every Python worker's S3 clients then go to the region's endpoint by boto3's own lookup,
    with no instance metadata read."""
    conf = node.path("conf")
    line = f"import os; os.environ.setdefault('SPARK_CONF_DIR', {conf!r})"
    if region:
        line += f"; os.environ.setdefault('AWS_DEFAULT_REGION', {region!r})"
    return line + "\n"


class SparkConf(Step):
    """spark-defaults.conf (the secret, security settings, GPUs; mode 0600) and the GPU discovery
    script, streamed as files into conf/ (0700): the secret is never on a command line. And the
    venv's .pth that points its Pythons at conf/."""

    name = "spark-conf"

    def files(self, conn: Conn) -> dict[str, tuple[str, int]]:
        """Remote path -> (text, mode) of every file this step writes."""
        n = self.ctx.node
        out = {n.path("conf", name): v for name, v in conf_files(self.ctx).items()}
        site = self.run(conn, f"echo {PythonEnv._site(n.python)}").strip()
        out[f"{site}/{CONF_PTH}"] = (conf_pth(n, self.ctx.plan.region), 0o644)
        return out

    def check(self, conn: Conn) -> bool:
        try:
            files = self.files(conn)
            have = self.run(
                conn,
                "; ".join(f"echo $(sha256sum {q(p)}) $(stat -c %a {q(p)})" for p in sorted(files)),
            )
        except CommandFailed:
            return False
        want = [f"{sha256_hex(text)} {p} {mode:o}" for p, (text, mode) in sorted(files.items())]
        return [" ".join(line.split()) for line in have.splitlines()] == want

    def apply(self, conn: Conn) -> None:
        for path, (text, mode) in self.files(conn).items():
            upload(conn, text.encode(), path, mode)


#: the install and configuration steps, in order (every node)
PREPARE: tuple[type[Step], ...] = (
    NodePython,
    Dirs,
    OsPackages,
    NvidiaDriver,
    PythonEnv,
    Pyspark,
    SparknetWheel,
    SparkConf,
)
