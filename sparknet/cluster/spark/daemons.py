"""The Spark standalone daemons as steps: the master and the workers.

Run from the venv's pyspark (`spark-class`: the pip pyspark has no `sbin/start-*.sh`), as
systemd units where systemd runs, else as background processes in their own session with pid
files under the prefix."""

from __future__ import annotations

import json

from sparknet.cluster.aws import autostop, userdata
from sparknet.cluster.remote import TAIL_LINES, CommandFailed, Conn, q, succeeds, tail_lines, upload
from sparknet.cluster.spark.spark_conf import systemd_unit
from sparknet.cluster.spark.steps import Step, conf_files, sha256_hex
from sparknet.node.command import node_command
from sparknet.spark_security import UI_HOST

#: the package script that installs, (re)starts, stops and removes a daemon's systemd unit
UNIT_SCRIPT = "systemd_unit.sh"

#: Spark's daemon classes, run through spark-class
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


# --- the Spark daemons ---------------------------------------------------------------------------


class Daemon(Step):
    """A Spark daemon (master or worker) from the venv's pyspark. Done when it runs with exactly
    today's command line, environment and conf (their hash, the stamp): a changed setting
    restarts it. A systemd unit where systemd runs, else a background process in its own session
    whose pid file is under the prefix (stopped through its process group), started, checked,
    waited for and stopped by `sparknet.node` there (`node.daemon`)."""

    role = "daemon"
    klass = ""

    def argv(self, spark_home: str) -> list[str]:
        raise NotImplementedError

    def env(self, spark_home: str) -> dict[str, str]:
        n = self.ctx.node
        return {
            "SPARK_HOME": spark_home,
            "SPARK_CONF_DIR": n.path("conf"),
            "SPARK_LOG_DIR": n.path("logs"),
            # the web UIs bind this address: only the SSH tunnel reaches them (RPC binds --host)
            "SPARK_LOCAL_IP": UI_HOST,
            "SPARK_LOCAL_DIRS": ",".join(self.ctx.local_dirs),
            "PYSPARK_PYTHON": n.python,
        }

    def spark_home(self, conn: Conn) -> str:
        return self.run(conn, node_command(self.ctx.node.python, "spark-home")).strip()

    def stamp(self, spark_home: str) -> str:
        what = [self.argv(spark_home), self.env(spark_home), sorted(conf_files(self.ctx).items())]
        return sha256_hex(json.dumps(what, sort_keys=True))[:16]

    @property
    def pid_file(self) -> str:
        return self.ctx.node.path("run", f"{self.role}.pid")

    @property
    def stamp_file(self) -> str:
        return self.ctx.node.path("run", f"{self.role}.stamp")

    @property
    def log_file(self) -> str:
        return self.ctx.node.path("logs", f"{self.role}.out")

    @property
    def unit(self) -> str:
        return f"sparknet-{self.role}.service"

    def check(self, conn: Conn) -> bool:
        try:
            stamp = self.stamp(self.spark_home(conn))
        except CommandFailed:
            return False
        if self.ctx.facts.systemd:
            unit = q(self.unit_file)
            return succeeds(
                conn, f"systemctl is-active -q {q(self.unit)} && grep -qF {q(stamp)} {unit}"
            )
        stamped = ["--stamp-file", self.stamp_file, "--stamp", stamp]
        return succeeds(conn, self._node("daemon-running", *self._which(), *stamped))

    def running(self, conn: Conn) -> bool:
        """Whether the daemon runs now, whatever its command line and conf."""
        if self.ctx.facts.systemd:
            return succeeds(conn, f"systemctl is-active -q {q(self.unit)}")
        return succeeds(conn, self._node("daemon-running", *self._which()))

    def _node(self, *args: object, unless_absent: bool = False) -> str:
        """The command line of `sparknet.node` on this node (`node.daemon`: the pid-file
        daemon's start, check, wait and stop are functions of the wheel there)."""
        return node_command(self.ctx.node.python, *args, unless_absent=unless_absent)

    def _which(self) -> list[str]:
        """What tells this daemon of this prefix from any other process: its pid file, its
        class (a word of its command line) and a path only this prefix's daemon has."""
        return ["--pid-file", self.pid_file, "--klass", self.klass, "--own", self.own_path]

    @property
    def own_path(self) -> str:
        """A path on the daemon's command line that only this prefix's daemon has."""
        return self.ctx.node.path("conf")

    def apply(self, conn: Conn) -> None:
        home = self.spark_home(conn)
        if self.ctx.facts.systemd:
            self._apply_unit(conn, home)
        else:
            self.stop(conn)
            self._start(conn, home)
        self.wait(conn)

    def _start(self, conn: Conn, home: str) -> None:
        env = [w for k, v in self.env(home).items() for w in ("--env", f"{k}={v}")]
        self.run(
            conn,
            self._node("daemon-start", "--pid-file", self.pid_file, "--stamp-file",
                       self.stamp_file, "--stamp", self.stamp(home), "--log", self.log_file,
                       "--cwd", self.ctx.node.prefix, *env, "--", *self.argv(home)),
        )  # fmt: skip

    def _apply_unit(self, conn: Conn, home: str) -> None:
        text = systemd_unit(
            f"sparknet Spark {self.role}",
            self.ctx.facts.user,
            self.env(home),
            [q(a) for a in self.argv(home)],
            self.stamp(home),
        ).replace(
            "[Service]\n",
            f"[Service]\nStandardOutput=append:{self.log_file}\nStandardError=inherit\n",
        )
        staged = self.ctx.node.path("run", self.unit)
        upload(conn, text.encode(), staged, 0o644)
        self.script(conn, UNIT_SCRIPT, "start", self.unit, staged, self.unit_file)

    def stop(self, conn: Conn, *, remove: bool = False) -> None:
        """Stop the daemon if it runs (by its pid file's process group, TERM then KILL); with
        `remove`, its systemd unit goes too, so a reboot does not start it again.

        On systemd a unit never installed is no error, but one still running (or installed,
        with `remove`) afterwards is CommandFailed: `sudo -n` refused (sudoers changed) must
        not pass silently, or `down` would delete the conf with the secret while the unit
        stays enabled, and the next boot would start the daemon with no authentication."""
        if self.ctx.facts.systemd:
            self._stop_unit(conn, remove)
            return
        self.run(
            conn,
            self._node("daemon-stop", *self._which(), "--stamp-file", self.stamp_file,
                       unless_absent=True),
            timeout=60,
        )  # fmt: skip

    @property
    def unit_file(self) -> str:
        return f"/etc/systemd/system/{self.unit}"

    def _stop_unit(self, conn: Conn, remove: bool) -> None:
        """`systemctl stop` (and with `remove`: disable, delete the unit file, reload), each
        step's complaint about a unit that is not there muted, then the verdict: the unit
        neither runs nor starts, and with `remove` its file is gone (UNIT_SCRIPT)."""
        args = ("remove", self.unit, self.unit_file) if remove else ("stop", self.unit)
        try:
            self.script(conn, UNIT_SCRIPT, *args)
        except CommandFailed as exc:
            why = f" ({exc.tail[-1]})" if exc.tail else ""
            raise CommandFailed(
                f"could not stop{' and remove' if remove else ''} {self.unit}{why}; the login "
                "user needs sudo without a password (sudo -n) for systemctl",
                exc.tail,
            ) from None

    def wait(self, conn: Conn) -> None:
        """Until the pid file names the daemon's JVM. `spark-class` is a shell script that runs a
        launcher JVM before it execs the daemon's; until then the check cannot tell it from
        another prefix's daemon, and on a loaded machine that takes seconds."""
        if self.ctx.facts.systemd:
            return
        self._until(
            conn,
            self._node("daemon-wait", *self._which(), "--within", DAEMON_START_S),
            DAEMON_START_S,
            f"the {self.role} did not start within {DAEMON_START_S} s",
        )

    def _until(self, conn: Conn, command: str, within_s: float, failed: str) -> None:
        """Run `command`, a wait of up to `within_s` on the node; when it fails, `failed` with
        the end of the daemon's log (why it did not come up)."""
        try:
            self.run(conn, command, within_s + 30)
        except CommandFailed as exc:
            log = self.run(conn, f"tail -n {TAIL_LINES} {q(self.log_file)}; true")
            raise CommandFailed(failed, tail_lines(log)) from exc


#: how long a started daemon's launcher may take to exec its JVM (about 1 s on an idle machine)
DAEMON_START_S = 90


#: how long a started master may take to listen (it is up in ~3 s on a small machine)
MASTER_START_S = 90


class Master(Daemon):
    name = "spark-master"
    role = "master"
    klass = MASTER_CLASS

    def argv(self, spark_home: str) -> list[str]:
        p, n = self.ctx.plan.ports, self.ctx.node
        return [f"{spark_home}/bin/spark-class", MASTER_CLASS, "--host", n.rpc_host,
                "--port", str(p.master), "--webui-port", str(p.master_ui)]  # fmt: skip

    def wait(self, conn: Conn) -> None:
        """Workers started before the master listens wait 5-15 s to retry: wait for its port."""
        super().wait(conn)
        host, port = self.ctx.node.rpc_host, self.ctx.plan.ports.master
        self._until(
            conn,
            self._node("wait-port", host, port, "--within", MASTER_START_S),
            MASTER_START_S,
            f"the master did not listen on {host}:{port} within {MASTER_START_S} s",
        )


class Worker(Daemon):
    name = "spark-worker"
    role = "worker"
    klass = WORKER_CLASS

    def argv(self, spark_home: str) -> list[str]:
        p, n = self.ctx.plan.ports, self.ctx.node
        return [f"{spark_home}/bin/spark-class", WORKER_CLASS, "--host", n.rpc_host,
                "--port", str(p.worker), "--webui-port", str(p.worker_ui),
                "--cores", str(self.ctx.cores), "--memory", f"{self.ctx.memory_mb}m",
                "--work-dir", n.path("work"), self.ctx.plan.master_url]  # fmt: skip


# --- the autostop timer --------------------------------------------------------------------------


class Autostop(Daemon):
    """The master's autostop timer (`autostop.run`), run as the Spark daemons are (a systemd
    unit, else a process in its own session with a pid file), so it outlives the SSH session.
    Its stamp covers its settings (cluster, region, minutes), written to the state dir: a
    changed setting restarts it, and a restart starts the timer afresh. With minutes 0 it runs
    and only records that it is off, so `cluster status` says so."""

    name = "autostop"
    role = "autostop"
    klass = "sparknet.cluster.aws.autostop"

    @property
    def settings(self) -> autostop.Settings:
        settings = self.ctx.plan.autostop
        if settings is None:
            raise CommandFailed("the plan has no autostop settings", [])
        return settings

    @property
    def state(self) -> str:
        return autostop.state_dir(self.ctx.node.prefix)

    @property
    def own_path(self) -> str:
        return self.state

    def spark_home(self, conn: Conn) -> str:
        return ""  # the timer is no Spark daemon: nothing of pyspark's is asked for

    def argv(self, spark_home: str) -> list[str]:
        return [self.ctx.node.python, "-m", self.klass, "run", "--state", self.state]

    def env(self, spark_home: str) -> dict[str, str]:
        return {"PYTHONUNBUFFERED": "1"}

    def stamp(self, spark_home: str) -> str:
        what = [self.argv(spark_home), self.env(spark_home), self.settings.to_json()]
        return sha256_hex(json.dumps(what, sort_keys=True))[:16]

    def check(self, conn: Conn) -> bool:
        """Running with today's stamp, and its settings file says today's settings."""
        if not super().check(conn):
            return False
        settings = q(f"{self.state}/{autostop.SETTINGS}")
        return self.run(conn, f"cat {settings} 2>/dev/null; true") == self.settings.to_json()

    @property
    def deadline_file(self) -> str:
        return f"{self.state}/{autostop.DEADLINE}"

    def apply(self, conn: Conn) -> None:
        """The settings, then the timer (re)started; the old deadline file goes first, so
        `wait` sees the new timer's first check (and `cluster status` never the old one's)."""
        self.run(
            conn,
            f"mkdir -p {q(self.state + '/' + autostop.ACTIVITY)} && rm -f {q(self.deadline_file)}",
        )
        upload(conn, self.settings.to_json().encode(), f"{self.state}/{autostop.SETTINGS}", 0o644)
        super().apply(conn)

    def wait(self, conn: Conn) -> None:
        """Until the timer has checked once (it does at its start): its deadline file is there."""
        super().wait(conn)
        self._until(
            conn,
            self._node("wait-file", self.deadline_file, "--within", DAEMON_START_S),
            DAEMON_START_S,
            f"the autostop timer did not check within {DAEMON_START_S} s",
        )


class BackstopOff(Step):
    """Cancel the node's backstop (`userdata`: the shutdown its user data schedules at each
    boot), which the master's autostop timer replaces: run on every node of an EC2 cluster once
    the timer runs, never before, so a bootstrap cut off earlier leaves every instance to its
    backstop. Done when the node has none left (`userdata.BACKSTOP_TOOL`'s `armed`: no per-boot
    script, no scheduled shutdown), so a second bootstrap of a finished cluster applies nothing."""

    name = "backstop-off"

    def check(self, conn: Conn) -> bool:
        return not self._backstop(conn, "armed").split()

    def apply(self, conn: Conn) -> None:
        self._backstop(conn, "cancel")

    def _backstop(self, conn: Conn, action: str) -> str:
        return self.script(conn, userdata.BACKSTOP_TOOL, action, userdata.BACKSTOP_SCRIPT)
