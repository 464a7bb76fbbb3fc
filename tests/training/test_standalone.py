"""`sparknet train --master spark://...` on the shared standalone cluster (two 1-core workers on
127.0.0.1): inner optimizer state stays with its partition, Spark settings reach the session, and
every task's torch threads come from its executor's cores; Spark settings that would break a run
stop it before Spark starts. Runs on the cluster go through the CLI in a subprocess: the test
process already holds a local SparkContext, and there is one per process."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from pyspark import TaskContext
from torch import nn

from sparknet.models import mlp
from sparknet.training.driver import train
from sparknet.training.rundir import is_run_entry
from tests.conftest import REPO, SPARKNET
from tests.helpers import cli_config, weights_hash

pytestmark = [pytest.mark.slow, pytest.mark.integration]

#: small and fast, but 20 rounds of momentum SGD whose state a lost partition would reset
RUN = (
    "train", "--data", "digits", "--model", "mlp", "--workers", "2", "--rounds", "20",
    "--tau", "2", "--batch-size", "16", "--lr", "0.05", "--momentum", "0.9",
    "--inner-state", "keep", "--seed", "7", "--eval-every", "0", "--checkpoint-every", "0",
)  # fmt: skip


def sparknet(*args: str, timeout: float = 400) -> subprocess.Popen:
    return subprocess.Popen(
        [str(SPARKNET), *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float = 400) -> str:
    """Wait for a run that must succeed; its stderr."""
    _out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return err


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _threads_checked(args: tuple[str, ...]) -> list[str]:
    """`args` with the built-in mlp wrapped by `threads_mlp` (the same weights), settings that
    reach the executors through `--conf`, and the opt-in worker daemon that imports torch
    before it forks: none of it may change a bit of the model."""
    checked = list(args)
    checked[checked.index("--model") + 1] = f"{__name__}:threads_mlp"
    return [
        *checked, "--conf", f"spark.executorEnv.PYTHONPATH={REPO}",
        "--conf", "spark.executorEnv.SPARKNET_TEST_THREADS=1",
        "--conf", "spark.python.daemon.module=sparknet.training.daemon",
    ]  # fmt: skip


def test_kept_inner_state_stays_with_its_partition_and_runs_are_bit_identical(
    standalone, spark, tmp_path
):
    """Also: `--conf` reaches the executors, and every task's torch runs on its executor's
    cores (run b: `threads_mlp` fails a task that does not)."""
    cluster = ("--master", standalone.master)
    # one app at a time: each takes every core of the cluster
    finish(sparknet(*RUN, *cluster, "--out", str(tmp_path / "a")))
    finish(sparknet(*_threads_checked(RUN), *cluster, "--out", str(tmp_path / "b")))
    # the same run on this process's local session (1 thread a task, as on the 1-core workers);
    # `auto` took allreduce on the cluster, this run takes it too, to compare bits
    train(cli_config(RUN[1:], transport="allreduce", out=tmp_path / "local"), spark=spark)

    for name in ("a", "b", "local"):
        misses = [r["inner_state_misses"] for r in rows(tmp_path / name)]
        assert misses == [0] * 20, f"{name}: {misses}"
    # the executors in every round's row on a cluster, none lost or joined; none on local[2]
    assert {(r["executors"], "executors_lost" in r) for r in rows(tmp_path / "a")} == {(2, False)}
    assert not any("executors" in r for r in rows(tmp_path / "local"))
    assert {yaml.safe_load((tmp_path / n / "config.yaml").read_text())["train"]["transport"]
            for n in ("a", "b", "local")} == {"allreduce"}  # fmt: skip
    # the executors share this machine's disk: the check that they see a local --out passed,
    # and its token is gone
    assert all(is_run_entry(p.name) for n in ("a", "b") for p in (tmp_path / n).iterdir())
    model = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == model
    assert (tmp_path / "local" / "model.safetensors").read_bytes() == model


def threads_mlp(num_classes: int) -> nn.Module:
    """The built-in mlp for digits, checking inside Spark tasks that torch runs on the threads
    the test expects (SPARKNET_TEST_THREADS, set through `--conf spark.executorEnv.*`)."""
    model = mlp((1, 8, 8), num_classes)

    def check(_module, _inputs) -> None:
        if TaskContext.get() is not None:  # in a task: the setting reached its executor
            want = os.environ.get("SPARKNET_TEST_THREADS")
            assert want is not None and torch.get_num_threads() == int(want), (
                torch.get_num_threads(), want,
            )  # fmt: skip

    model.register_forward_pre_hook(check)
    return model


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # refused by sparknet (the other refusals are test_session.py's, of the same function)
        (("--conf", "spark.speculation=true"), "error: Spark setting spark.speculation=true: a"),
        # refused by Spark's launcher, which prints a Java stack trace that the line says already
        (
            ("--conf", "spark.executor.memory=lots"),
            "error: could not start Spark (master local[",
        ),
    ],
)
def test_spark_settings_that_would_break_a_run_stop_it_in_one_line(tmp_path, args, message):
    out = tmp_path / "refused"
    proc = sparknet("train", "--rounds", "1", "--tau", "1", "--out", str(out), *args)
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert err.strip().splitlines()[-1].startswith(message), err
    assert "Traceback" not in err
    assert "\tat org.apache" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--conf", "spark.task.cpus=2"), "spark.task.cpus"),  # the workers have 1 core each
        (("--gpus-per-worker", "1"), "no executor with a GPU registered in 2 s; the workers need"),
    ],
)
def test_a_cluster_that_can_never_run_a_task_stops_the_run_in_one_line(
    standalone, tmp_path, args, message
):
    """One bounded wait for executors (here 2 s), then one line: not a hang at the first job."""
    out = tmp_path / "no-slot"
    proc = sparknet(
        "train", "--rounds", "1", "--tau", "1", "--workers", "2", "--master", standalone.master,
        "--conf", "spark.scheduler.maxRegisteredResourcesWaitingTime=2s", "--out", str(out),
        *args,
    )  # fmt: skip
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: no executor") and message in last, err
    assert "Traceback" not in err


def test_a_dataframe_run_keeps_its_partitions_in_place(standalone, tmp_path):
    """The DataFrame path maps over the frame's persisted partitions, whose blocks, not the
    anchor's, keep each task on the executor holding its inner state. (`auto` takes allreduce
    on a cluster, as the kept-state test shows; allreduce on a DataFrame, whose tasks keep
    their state in memory, is test_allreduce_frames.py's.)"""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sparknet.data.sources import digits

    train, _ = digits()
    x, y = train.tensors
    table = pa.table(
        {"features": [row.tolist() for row in x.reshape(len(x), -1)], "label": y.tolist()}
    )
    pq.write_table(table, tmp_path / "digits.parquet")
    out = tmp_path / "frame"
    proc = sparknet(
        "train", "--data", f"parquet:{tmp_path / 'digits.parquet'}", "--model", "mlp",
        "--workers", "2", "--rounds", "8", "--tau", "2", "--batch-size", "16",
        "--inner-state", "keep", "--eval-every", "0", "--master", standalone.master,
        "--transport", "spark", "--out", str(out),
    )  # fmt: skip
    finish(proc)
    assert [r["inner_state_misses"] for r in rows(out)] == [0] * 8
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["transport"] == "spark"


def _executor_pids(work_dirs: tuple[Path, ...]) -> list[int]:
    """The executor JVMs the shared cluster's workers run (their cwd is under a work dir)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(proc / "cwd"))
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"CoarseGrainedExecutorBackend" in cmdline and any(
            cwd.is_relative_to(w) for w in work_dirs
        ):
            pids.append(int(proc.name))
    return pids


def _lost_run(transport: str) -> list[str]:
    """RUN on `transport`, 40 rounds with a checkpoint every 5: time to kill an executor."""
    args = [*RUN, "--transport", transport]
    args[args.index("--checkpoint-every") + 1] = "5"
    args[args.index("--rounds") + 1] = "40"
    return args


@pytest.fixture(scope="module")
def undisturbed(spark, tmp_path_factory) -> Callable[[str], str]:
    """The weights hash of `_lost_run(transport)` without a fault, trained once per transport
    (their last bits differ) in this process on local[2,2]: the cluster's bits, as one thread
    runs each task on both and the sums go in partition order."""
    hashes: dict[str, str] = {}

    def of(transport: str) -> str:
        if transport not in hashes:
            out = tmp_path_factory.mktemp("undisturbed") / transport
            train(cli_config(_lost_run(transport)[1:], out=out), spark=spark)
            hashes[transport] = weights_hash(out)
        return hashes[transport]

    return of


@pytest.mark.parametrize("transport", ["spark", "allreduce"])
def test_a_lost_executor_and_its_successor_show_in_the_rounds(
    standalone, tmp_path, transport, undisturbed
):
    """An executor killed mid-run. `spark`: often in the middle of its task: Spark then keeps
    the task waiting for the dead executor's block, and the round's job is run again; its tasks
    run on the other one, without their inner state, so the rounds since the last checkpoint
    are replayed (at most once: the partitions spread over the new executor only after a
    checkpoint, where they find their state). `allreduce`: the stage fails and runs again from
    the last checkpoint once Spark's master has started a new executor on the worker. Either
    way the round rows say both (`executors_lost`, then `executors_joined`); the run ends with every
    round once and with the weights of a run without the loss."""
    import signal
    import time

    out = tmp_path / "lost"
    proc = sparknet(*_lost_run(transport), "--master", standalone.master, "--out", str(out))
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").exists() or len(rows(out)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    victims = _executor_pids(standalone.work_dirs)
    assert len(victims) == 2, victims
    os.kill(victims[0], signal.SIGKILL)
    err = finish(proc)
    got = rows(out)
    assert [r["round"] for r in got] == list(range(1, 41))
    lost = [r for r in got if "executors_lost" in r]
    joined = [r for r in got if "executors_joined" in r]
    assert len(lost) == 1 and len(joined) == 1, [(r["round"], r["executors"]) for r in got]
    assert lost[0]["round"] <= joined[0]["round"]
    assert lost[0]["executors_lost"][0].endswith("@127.0.0.1")
    assert got[-1]["executors"] == 2
    assert weights_hash(out) == undisturbed(transport)
    assert [r["inner_state_misses"] for r in got] == [0] * 40
    # at most one replay: none where the loss fell in a round right after a checkpoint
    assert "(replay 2 of" not in err, err[-3000:]


def _master_ui(standalone) -> str:
    """The master UI's address (the fixture lets the kernel choose its port)."""
    import re

    log = (standalone.log_dir / "master.log").read_text()
    port = re.findall(r"MasterWebUI.*?started at https?://[^\s:]+:(\d+)", log)
    assert port, log[-2000:]
    return f"http://127.0.0.1:{port[-1]}"


def _kill_app_from_the_master_ui(standalone, name: str) -> str:
    """Kill the running application `name` as a user of the master's UI does (its kill link
    posts the page's CSRF token); its id."""
    import re
    import urllib.parse
    import urllib.request

    ui = _master_ui(standalone)
    with urllib.request.urlopen(f"{ui}/json/", timeout=10) as answer:
        apps = [a for a in json.loads(answer.read())["activeapps"] if a["name"] == name]
    assert len(apps) == 1, apps
    with urllib.request.urlopen(f"{ui}/", timeout=10) as answer:
        page = answer.read().decode()
    token = re.search(
        r'name="csrfToken"\s+value="([^"]*)"|value="([^"]*)"\s+name="csrfToken"', page
    )
    form = {"id": apps[0]["id"], "terminate": "true"}
    if token:
        form["csrfToken"] = token.group(1) or token.group(2)
    data = urllib.parse.urlencode(form).encode()
    urllib.request.urlopen(f"{ui}/app/kill/", data=data, timeout=10).close()
    return apps[0]["id"]


def test_an_app_killed_from_outside_ends_the_driver_in_one_line_and_it_binds_one_address(
    standalone, tmp_path
):
    """`sparknet train --master spark://...` started as a user on a node starts it (no
    SPARK_LOCAL_IP): while it runs, every socket its driver's JVM listens on is on the address
    the master is reached from (RPC, block manager) or loopback (UI), none on every interface.
    Then the application is killed on the master's UI: the driver ends with one `error:` line,
    no Py4JJavaError traceback."""
    import time

    from tests.sockets import descendants, listeners

    out = tmp_path / "killed"
    args = [*RUN, "--master", standalone.master, "--out", str(out)]  # auto: allreduce
    args[args.index("--rounds") + 1] = "400"
    env = {k: v for k, v in os.environ.items() if k != "SPARK_LOCAL_IP"}
    proc = subprocess.Popen(
        [str(SPARKNET), *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or len(rows(out)) < 1:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.2)
        bound = listeners(descendants(proc.pid))
        assert bound and {w.address for w in bound} == {"127.0.0.1"}, [str(w) for w in bound]
        _kill_app_from_the_master_ui(standalone, "sparknet")
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: Spark stopped the application"), err[-3000:]
    assert "Traceback" not in err and "Py4J" not in err and "\tat " not in err, err[-3000:]
    assert "warning: the allreduce stage failed" not in err  # no restart on a dead context
