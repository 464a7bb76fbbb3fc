"""Tracking in MLflow against a real MLflow: the file store, and a `mlflow server` on 127.0.0.1.
A run's settings are params, each round a step, the run dir's files and the model artifacts
(`mlflow.pytorch.load_model` gives a module that predicts as the run's weights do); a resumed
run continues the same MLflow run; a server that is down costs one warning and nothing else;
`--mlflow` without MLflow installed is one line before Spark."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import mlflow
import pytest
import torch

import sparknet
from sparknet.config import TrainConfig
from sparknet.data.sources import digits
from sparknet.training.driver import train
from sparknet.training.report import read_metrics
from tests.conftest import REPO, SPARKNET

pytestmark = pytest.mark.integration

SMALL = {"model": "mlp", "workers": 2, "tau": 10, "batch_size": 32, "lr": 0.1, "eval_every": 2}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 (its own SQLite store and artifact dir)."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    with (root / "log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
             "--backend-store-uri", f"sqlite:///{root / 'db.sqlite'}", "--artifacts-destination",
             str(root / "artifacts"), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                log = (root / "log").read_text()
                raise RuntimeError(f"mlflow server did not start: {log}") from None
            time.sleep(0.5)
    yield url
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)


def _tracked(run_dir, uri: str):
    record = json.loads((run_dir / "mlflow.json").read_text())
    assert record["tracking_uri"] == uri
    client = mlflow.tracking.MlflowClient(uri)
    return client, client.get_run(record["run_id"])


def _predicts_as_the_run(uri: str, run_id: str, run_dir) -> None:
    mlflow.set_tracking_uri(uri)
    module = mlflow.pytorch.load_model(f"runs:/{run_id}/model")
    assert isinstance(module, torch.nn.Module)
    inputs, _ = digits()[1].tensors
    with torch.no_grad():
        assert torch.equal(module(inputs), sparknet.load_model(run_dir)(inputs))


def test_the_file_store_gets_params_steps_artifacts_and_the_model_and_a_resume_goes_on(
    spark, tmp_path, monkeypatch
):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps it behind a switch
    uri, run_dir = (tmp_path / "mlruns").as_uri(), tmp_path / "run"
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run() as own:  # a notebook's own run: sparknet's is another, made whole
        train(TrainConfig(rounds=2, out=run_dir, mlflow=uri, **SMALL), spark=spark)
    client, run = _tracked(run_dir, uri)
    assert run.info.run_id != own.info.run_id
    assert run.info.status == "FINISHED"
    assert (run.data.params["tau"], run.data.params["lr"], run.data.params["rounds"]) == (
        "10",
        "0.1",
        "2",
    )
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2]
    rows = read_metrics(run_dir)
    assert run.data.metrics["eval_accuracy"] == rows[-1]["eval_accuracy"]
    assert run.data.metrics["seconds.total"] == rows[-1]["seconds"]["total"]
    names = {a.path for a in client.list_artifacts(run.info.run_id, "run_dir")}
    assert names == {f"run_dir/{n}" for n in ("config.yaml", "metrics.jsonl", "curves.png",
                                             "model.json", "model.safetensors")}  # fmt: skip
    _predicts_as_the_run(uri, run.info.run_id, run_dir)

    # the resume continues the same MLflow run: rounds 3 and 4 are its next steps
    train(TrainConfig(rounds=4, out=run_dir, mlflow=uri, **SMALL), spark=spark, resume=True)
    client, again = _tracked(run_dir, uri)
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4]
    assert again.data.params["rounds"] == "2"  # a param is written once: the first run's
    _predicts_as_the_run(uri, run.info.run_id, run_dir)


def test_a_cli_run_is_tracked_on_an_mlflow_server(server, tmp_path):
    done = subprocess.run(
        [str(SPARKNET), "train", "--data", "digits", "--model", "mlp", "--workers", "2",
         "--rounds", "2", "--tau", "10", "--out", str(tmp_path / "run"), "--mlflow", server],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr
    client, run = _tracked(tmp_path / "run", server)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2]
    _predicts_as_the_run(server, run.info.run_id, tmp_path / "run")


def test_a_server_that_is_down_is_one_warning_and_the_run_goes_on(tmp_path):
    down = f"http://127.0.0.1:{_free_port()}"
    started = time.monotonic()
    done = subprocess.run(
        [str(SPARKNET), "train", "--data", "digits", "--model", "mlp", "--workers", "2",
         "--rounds", "2", "--tau", "10", "--out", str(tmp_path / "run")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "MLFLOW_TRACKING_URI": down},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    warnings = [ln for ln in done.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"warning: MLflow at {down} failed to start the run ("
    )
    assert warnings[0].endswith("); the run goes on without it, its metrics in the run dir")
    assert [r["round"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    assert not (tmp_path / "run" / "mlflow.json").exists()
    assert time.monotonic() - started < 120


def test_the_setting_without_mlflow_installed_is_one_line_before_spark(tmp_path):
    hide = (
        "import sys; sys.modules['mlflow'] = None; from sparknet.cli import main; "
        f"sys.argv = ['sparknet', 'train', '--out', {str(tmp_path / 'run')!r}, '--mlflow', "
        "'http://127.0.0.1:1']; main()"
    )
    done = subprocess.run([sys.executable, "-c", hide], cwd=REPO, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == (
        "error: --mlflow http://127.0.0.1:1 needs MLflow: pip install 'sparknet[mlflow]' (or "
        "leave it out)\n"
    )
    assert not (tmp_path / "run").exists()


def test_a_run_given_up_on_mid_run_is_marked_failed_at_the_end_not_left_running(
    tmp_path, monkeypatch
):
    """MLflow failing at a round (stood in for by the client's own call raising once: a real
    server cannot be stopped at a given round here) is one warning; the run's later rounds
    are not logged, and at the end, the server answering again, its MLflow run is FAILED with
    a tag naming why, not RUNNING for ever."""
    from sparknet.data.store import LocalStore
    from sparknet.training.tracking import Tracker

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    warned: list[str] = []
    (tmp_path / "run").mkdir()
    cfg = TrainConfig(rounds=3, out=tmp_path / "run", mlflow=uri, **SMALL)
    tracker = Tracker.start(cfg, LocalStore(tmp_path / "run"), str(tmp_path / "run"),
                            warned.append)  # fmt: skip
    run_id = tracker.run_id
    tracker.round({"round": 1, "loss": 1.0})
    real = tracker.client.log_batch
    monkeypatch.setattr(tracker.client, "log_batch", lambda *a, **k: (_ for _ in ()).throw(
        ConnectionError("connection refused")))  # fmt: skip
    tracker.round({"round": 2, "loss": 0.5})
    monkeypatch.setattr(tracker.client, "log_batch", real)
    tracker.round({"round": 3, "loss": 0.25})
    tracker.stop(interrupted=False)
    assert len(warned) == 1 and "failed to log a round (connection refused)" in warned[0]
    client = mlflow.tracking.MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["sparknet.tracking"].startswith(
        "MLflow failed to log a round: connection refused; every metric is in "
    )
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1]
