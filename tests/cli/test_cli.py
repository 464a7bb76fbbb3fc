"""The command line's contract for bad input: one line that says what to fix, exit 2, no
traceback, nothing written. These fail before Spark starts, so they are quick."""

import os
import signal
import subprocess
import sys

import pytest
import typer

from sparknet.errors import SparknetError
from tests.conftest import REPO, SPARKNET


def run_cli(
    *args: str, cwd=REPO, env: dict[str, str | None] | None = None
) -> subprocess.CompletedProcess:
    """Run `sparknet`; `env` adds to the environment, and a None value removes the variable."""
    merged = {**os.environ, **(env or {})}
    return subprocess.run(
        [str(SPARKNET), *args], cwd=cwd, capture_output=True, text=True, timeout=120,
        env={k: v for k, v in merged.items() if v is not None},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "resnet9000"], "unknown model 'resnet9000'"),
        (["--data", "mnist-please"], "unknown dataset 'mnist-please'"),
        (["--model", "no_such_pkg.models:net"], "cannot import module 'no_such_pkg'"),
        (["--model", "tests.helpers:nothing"], "has no attribute 'nothing'"),
        (["--model", "tests.helpers:identical_samples"], "not a torch.nn.Module"),
        (["--workers", "5000"], "5000 Spark tasks are more than the 1437 training samples"),
        (["--tau", "0"], "invalid setting tau"),
        (["--model", "resnet18"], "model 'resnet18' cannot take inputs of shape (1, 8, 8)"),
        (["--resume"], "--resume needs --out"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    out = tmp_path / "run"
    proc = (
        run_cli("train", "--out", str(out), *args)
        if "--resume" not in args
        else run_cli("train", *args)
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and message in lines[0]
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_debug_shows_the_traceback(tmp_path):
    proc = run_cli("train", "--out", str(tmp_path / "r"), "--model", "nope", "--debug")
    assert proc.returncode != 0
    assert "SparknetError" in proc.stderr and "Traceback" in proc.stderr


def test_an_existing_run_dir_is_not_overwritten(tmp_path):
    """A dir with a complete checkpoint holds a run (without one, a new run may start over)."""
    (tmp_path / "config.yaml").write_text("train: {}\n")
    done = tmp_path / "checkpoints" / "round-00005"
    done.mkdir(parents=True)
    (done / "state.json").write_text('{"rounds": 5, "elapsed_s": 1.0}')
    proc = run_cli("train", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "already holds a run; pass --resume" in proc.stderr
    assert (tmp_path / "config.yaml").read_text() == "train: {}\n"


def test_missing_java_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "JAVA_HOME": str(tmp_path / "no-jdk")}
    proc = subprocess.run(
        [str(SPARKNET), "train", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    progress = ("round", "starting Spark")  # plain progress lines: stderr is not a terminal
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith(progress)]
    assert lines == [
        f"error: Spark needs Java 17+ and found JAVA_HOME={tmp_path / 'no-jdk'} has no bin/java: "
        "install it (e.g. apt-get install -y openjdk-17-jre-headless) or point JAVA_HOME at it"
    ]
    assert not out.exists()


def test_fail_prints_the_first_non_empty_line(capsys):
    from sparknet.cli.common import fail

    with pytest.raises(typer.Exit) as exc:
        fail(SparknetError("\n  the real message\nmore detail"), debug=False)
    assert exc.value.exit_code == 2
    assert capsys.readouterr().err == "error: the real message\n"


@pytest.mark.parametrize("inside", [False, True], ids=["out-is-a-file", "out-under-a-file"])
def test_out_on_a_file_is_one_line_exit_2(tmp_path, inside):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine\n")
    out = blocker / "run" if inside else blocker
    proc = run_cli("train", "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: --out {out}: {blocker} is a file; choose a directory for the run"
    ]
    assert blocker.read_text() == "mine\n"


def test_resume_with_other_workers_is_refused_before_spark(tmp_path):
    from sparknet.config import TrainConfig

    (tmp_path / "config.yaml").write_text(TrainConfig(workers=2, out=tmp_path).to_yaml())
    proc = run_cli("train", "--out", str(tmp_path), "--resume", "--workers", "3", "--rounds", "40")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: resuming {tmp_path} would change workers 2 -> 3, so it would no longer equal an "
        "uninterrupted run; drop the change, or pass --allow-change to continue anyway"
    ]


def test_a_signal_whose_interrupt_was_lost_stops_at_the_next_event():
    """A KeyboardInterrupt raised inside a finalizer while Spark starts is only printed as
    "Exception ignored"; the run must still stop at its next event, not train to the end."""
    from sparknet.cli.common import Caught
    from sparknet.cli.train import _Report

    caught = Caught()
    report = _Report(live=False, caught=caught)
    report.status("starting Spark")  # nothing caught yet: goes on
    caught.signum = signal.SIGINT
    for event in (
        lambda: report.status("starting Python workers"),
        lambda: report.start(0, 3),
        lambda: report.round({"round": 1}),
    ):
        with pytest.raises(KeyboardInterrupt):
            event()


def test_a_signal_in_a_finalizer_leaves_no_traceback_and_still_stops(tmp_path):
    """A SIGTERM that lands in a weakref callback (an import's module lock, on a node driver)
    cannot raise there: Python would print "Exception ignored" and a traceback into the job's
    log. It is noted silently, and `check()` raises it where the run goes on."""
    script = (
        "import os, signal, weakref\n"
        "from sparknet import interrupts\n"
        "interrupts.catch_from_start()\n"
        "class A: pass\n"
        "a = A()\n"
        "def callback(_):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    sum(range(10**6))  # the handler runs here, inside the callback\n"
        "ref = weakref.ref(a, callback)\n"
        "del a\n"
        "print('went on')\n"
        "try:\n"
        "    interrupts.check()\n"
        "except KeyboardInterrupt:\n"
        "    print('stopped', interrupts.received())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.stdout.split("\n")[:2] == ["went on", f"stopped {int(signal.SIGTERM)}"]
    assert done.stderr == ""
