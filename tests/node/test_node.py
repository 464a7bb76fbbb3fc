"""What runs on a node, called as the functions of the wheel they are (`sparknet.node`): a
pid-file daemon's start, check, wait and stop; a job's state, cancel and log; the command line
the submitter sends; the scripts and templates shipped as files. Real processes, no SSH."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sparknet.node import daemon, files, job
from sparknet.node.__main__ import main
from sparknet.node.command import node_command

KLASS = "org.example.Daemon"


def _gone(pid: int, within_s: float = 10.0) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.02)
    return False


def _start(tmp_path: Path, klass: str = KLASS) -> tuple[int, Path]:
    """A daemon (a sleep whose command line holds `klass` and tmp_path/conf) started by
    `daemon.start`; its pid and pid file. A thread reaps it, as init would a daemon."""
    pid_file = tmp_path / "d.pid"
    argv = [sys.executable, "-c", "import time; time.sleep(60)", klass, str(tmp_path / "conf")]
    pid = daemon.start(argv, {"X": "1"}, str(tmp_path), str(tmp_path / "d.log"), str(pid_file),
                       str(tmp_path / "d.stamp"), "s1")  # fmt: skip
    threading.Thread(target=_reap, args=(pid,), daemon=True).start()
    return pid, pid_file


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):  # reaped elsewhere
        os.waitpid(pid, 0)


def test_a_daemon_is_alive_only_as_its_own_class_of_its_own_prefix_and_stops(tmp_path) -> None:
    pid, pid_file = _start(tmp_path)
    try:
        assert os.getpgid(pid) == pid  # a session of its own: the SSH session may end
        own = str(tmp_path / "conf")
        assert daemon.wait_started(str(pid_file), KLASS, own, 10)
        assert daemon.running(pid_file, KLASS, own, str(tmp_path / "d.stamp"), "s1")
        assert not daemon.running(pid_file, KLASS, own, str(tmp_path / "d.stamp"), "s2")
        assert not daemon.alive(pid_file, "org.example.Other", own)
        assert not daemon.alive(pid_file, KLASS, str(tmp_path / "elsewhere"))
        daemon.stop(str(pid_file), str(tmp_path / "d.stamp"), KLASS, own)
        assert _gone(pid)
        assert not pid_file.exists() and not (tmp_path / "d.stamp").exists()
    finally:
        with pytest.raises(OSError):
            os.killpg(pid, signal.SIGKILL)


def test_a_pid_file_naming_another_process_is_not_the_daemon(tmp_path) -> None:
    """The number in a stale pid file may be another process's by now: it is left alone."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "d.pid").write_text(f"{other.pid}\n")
        assert not daemon.alive(tmp_path / "d.pid", KLASS, str(tmp_path))
        assert not daemon.wait_started(str(tmp_path / "d.pid"), KLASS, str(tmp_path), 0.1)
        daemon.stop(str(tmp_path / "d.pid"), str(tmp_path / "d.stamp"), KLASS, str(tmp_path))
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_a_wait_for_a_daemon_whose_process_ended_fails_at_once(tmp_path) -> None:
    (tmp_path / "d.pid").write_text(f"{2**22 + 1}\n")
    began = time.monotonic()
    assert not daemon.wait_started(str(tmp_path / "d.pid"), KLASS, str(tmp_path), 30)
    assert time.monotonic() - began < 5


def test_the_waits_for_a_port_and_a_file(tmp_path) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert daemon.wait_listening("127.0.0.1", server.getsockname()[1], 5)
    assert not daemon.wait_listening("127.0.0.1", 1, 0.1)
    target = tmp_path / "deadline.json"
    threading.Timer(0.05, target.write_text, args=("{}",)).start()
    assert daemon.wait_file(str(target), 10)
    assert not daemon.wait_file(str(tmp_path / "never"), 0.1)


# --- a job on its master -------------------------------------------------------------------------


def _session(tmp_path: Path, script: str) -> Path:
    """A job dir whose supervisor is `sh -c script` in a session of its own (reaped here: an
    orphan waits for this machine's init, seconds)."""
    jd = tmp_path / "jobs" / "R"
    jd.mkdir(parents=True)
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    threading.Thread(target=proc.wait, daemon=True).start()
    (jd / job.PID).write_text(f"{proc.pid}\n")
    return jd


def test_a_jobs_state_from_its_files_and_its_session(tmp_path) -> None:
    assert job.state(tmp_path / "none") == job.GONE
    jd = _session(tmp_path, "exec sleep 60")
    assert job.state(jd) == "running" and job.rc(jd) is None
    assert job.live_jobs(tmp_path / "jobs") == ["R"]
    assert job.cancel(jd, wait_s=10)
    assert job.state(jd) == job.CANCELLED and job.rc(jd) == -1
    assert not job.cancel(jd)  # nothing of it is left: left as it ended
    (jd / job.RC).write_text("3\n")
    assert job.state(jd) == "failed 3"  # an exit code wins over the cancel marker
    (jd / job.RC).write_text("0\n")
    assert job.state(jd) == "succeeded"
    (jd / job.RC).write_text("12x\n")
    assert job.state(jd) == "failed -1"
    (jd / job.RC).unlink()
    (jd / job.CANCELLED).unlink()
    assert job.state(jd) == job.KILLED


def test_a_job_whose_supervisor_died_leaving_its_driver_is_orphaned_and_stopped(tmp_path) -> None:
    jd = _session(tmp_path, "sleep 60 & exit 0")  # the leader ends, its child runs on
    end = time.monotonic() + 10
    while job.rc(jd) is None and time.monotonic() < end:
        time.sleep(0.02)
    assert job.state(jd) == job.ORPHANED
    job.stop_session(jd, wait_s=0.5, poll_s=0.05)  # the sleep dies of the TERM to the group
    assert not job.group_alive(jd)
    assert job.state(jd) == job.KILLED


def test_a_job_that_ignores_sigterm_is_killed_after_the_wait(tmp_path) -> None:
    jd = _session(tmp_path, "trap '' TERM; exec sleep 60")
    pid = daemon.read_pid(jd / job.PID)
    while "sleep" not in (daemon.cmdline(pid) or [""])[0]:  # the trap is set by then
        time.sleep(0.01)
    began = time.monotonic()
    job.stop_session(jd, wait_s=0.5, poll_s=0.05)
    assert not job.group_alive(jd)
    assert 0.4 < time.monotonic() - began < 10


def test_end_jobs_marks_and_signals_every_live_session(tmp_path) -> None:
    jd = _session(tmp_path, "exec sleep 60")
    job.end_jobs(tmp_path / "jobs")
    assert (jd / job.CANCELLED).exists()
    end = time.monotonic() + 10
    while job.group_alive(jd) and time.monotonic() < end:
        time.sleep(0.02)
    assert not job.group_alive(jd)
    assert job.live_jobs(tmp_path / "nowhere") == []


def test_the_log_is_read_by_the_bytes_the_node_counts(tmp_path) -> None:
    log = tmp_path / "driver.log"
    assert job.log_since(log, 0, 5) == b"0\n"
    log.write_bytes(b"a\nb\nx\xffy\nc")
    assert job.log_since(log, 0, 2) == b"9\nx\xffy\nc"
    assert job.log_since(log, 0, 9) == b"9\na\nb\nx\xffy\nc"
    assert job.log_since(log, 4) == b"9\nx\xffy\nc"
    assert job.log_since(log, 9) == b"9\n"
    assert job.log_since(log, 0, 0) == b"9\n"


# --- the command line and the files --------------------------------------------------------------


def test_the_command_line_runs_the_module_and_quotes_its_words() -> None:
    assert node_command("/p/venv/bin/python", "job-rc", "/p/jobs/a b") == (
        "/p/venv/bin/python -m sparknet.node job-rc '/p/jobs/a b'"
    )
    guarded = node_command("/p/py", "jobs-end", "/p/jobs", unless_absent=True)
    assert guarded == (
        "if /p/py -c 'import sparknet.node' 2>/dev/null; then "
        "/p/py -m sparknet.node jobs-end /p/jobs; fi"
    )
    # no venv: nothing to end, and what follows on the line still runs
    after = subprocess.run(["sh", "-c", guarded + "; echo after"], capture_output=True, text=True)
    assert (after.returncode, after.stdout) == (0, "after\n")
    here = node_command(sys.executable, "spark-home", unless_absent=True)  # this venv has it
    assert subprocess.run(["sh", "-c", here], capture_output=True, text=True).stdout.strip()


def test_the_module_answers_as_the_submitter_reads_it(tmp_path, capsys) -> None:
    jd = tmp_path / "jobs" / "R"
    jd.mkdir(parents=True)
    (jd / job.RC).write_text("7\n")
    assert main(["job-rc", str(jd)]) == 0
    assert main(["job-state", str(jd)]) == 0
    assert main(["wait-file", str(tmp_path / "never"), "--within", "0.1"]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == ["7", "failed 7"]
    assert err.strip().endswith("is not written within 0.1 s")


def test_the_masters_state_is_its_uis_json_or_the_line_a_traceback_ends_with(capsys) -> None:
    """`master-json` prints the master UI's `/json/` page; where nothing answers, it exits 1
    with the one line `cluster status` shows as why the master does not answer."""
    import http.server

    class Master(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"status": "ALIVE", "path": "%s"}' % self.path.encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args) -> None:
            pass  # quiet

    server = http.server.HTTPServer(("127.0.0.1", 0), Master)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    try:
        assert main(["master-json", "127.0.0.1", str(server.server_port)]) == 0
        out, _ = capsys.readouterr()
        assert out == '{"status": "ALIVE", "path": "/json/"}\n'
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["master-json", "127.0.0.1", str(port)]) == 1
    _, err = capsys.readouterr()
    assert err.startswith("urllib.error.URLError: <urlopen error [Errno 111]")
    assert len(err.splitlines()) == 1


def test_torchs_build_is_read_from_its_files(capsys) -> None:
    """What a baked image's tags say of torch: its version and the CUDA it was built for."""
    import importlib.metadata
    import re

    assert main(["torch-build"]) == 0
    version, cuda = capsys.readouterr().out.split()
    assert version == importlib.metadata.version("torch")
    assert cuda == "none" or re.fullmatch(r"\d+\.\d+", cuda), cuda


def test_the_scripts_and_templates_are_files_of_the_package() -> None:
    for name in ("marker.sh", "apt_install.sh", "facts.sh", "nvswitches.sh", "gpus.sh",
                 "systemd_unit.sh", "backstop.sh"):  # fmt: skip
        checked = subprocess.run(
            ["sh", "-n"], input=files.script(name), text=True, capture_output=True
        )
        assert checked.returncode == 0, (name, checked.stderr)
    compile(files.script("torch_fits.py"), "torch_fits.py", "exec")
    backstop = files.template("backstop.sh", minutes=5, why="'a b'")
    assert backstop == "#!/bin/sh\nexec shutdown -P +5 'a b'\n"
    with pytest.raises(KeyError):  # a field left unfilled is an error, never a blank
        files.template("backstop.sh", minutes=5)
