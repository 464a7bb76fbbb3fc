"""A run in MLflow: settings as params, a step a round, the run dir and the model as artifacts.

`mlflow.pytorch.load_model` gives back the `nn.Module`.

Optional (`pip install sparknet[mlflow]`), and never in the way of training: a tracking server
that cannot be reached, or that fails later, is one warning, and the run goes on with its metrics
in the run dir as always. Each call to MLflow is given one retry and a short timeout (MLflow's
own default retries with backoff for minutes, a stall between two rounds). The run dir records
which MLflow run is its own (`mlflow.json`), so a resumed run continues the same MLflow run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from sparknet.config import TrainConfig
from sparknet.data.store import MissingObjectError, Store
from sparknet.environment import variables
from sparknet.errors import SettingError, first_line
from sparknet.training.rundir import (
    CONFIG_FILE,
    CURVES,
    METRICS,
    MLFLOW_RUN,
    MODEL_FILE,
    MODEL_INFO,
)
from sparknet.training.saved_model import SavedModel

#: the experiment runs go to where MLFLOW_EXPERIMENT_NAME names none
EXPERIMENT = "sparknet"
#: the run dir's files that go to MLflow as artifacts (under `run_dir/`), as they are at the end
ARTIFACTS = (CONFIG_FILE, METRICS, CURVES, MODEL_INFO, MODEL_FILE)
#: what each MLflow call may take: one retry, ten seconds a request
_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}

Warn = Callable[[str], None]


def tracking_uri(cfg: TrainConfig) -> str | None:
    """The tracking URI a run logs to: the `mlflow` setting, else MLFLOW_TRACKING_URI."""
    return cfg.mlflow or os.environ.get("MLFLOW_TRACKING_URI") or None


def check_installed(cfg: TrainConfig) -> None:
    """Before Spark starts: the `mlflow` setting needs MLflow installed (a URI from the
    environment alone does not: the tracker then warns and the run goes on)."""
    if cfg.mlflow is None:
        return
    try:
        import mlflow  # noqa: F401  # lazy: an optional extra, seconds to import
    except ImportError:
        raise SettingError(
            "{@mlflow=value} needs MLflow: pip install 'sparknet[mlflow]' (or leave it out)",
            setting="mlflow", value=cfg.mlflow,
        ) from None  # fmt: skip


class Tracker:
    """One run's MLflow run, or nothing once MLflow has failed (said once through `warn`)."""

    def __init__(self, uri: str | None, store: Store, run_text: str, warn: Warn) -> None:
        self.uri, self.store, self.run_text, self.warn = uri, store, run_text, warn
        self.client: Any = None
        self.run_id: str | None = None
        #: the MLflow run given up on when MLflow failed mid-run, and what failed: at the end
        #: it is marked FAILED if the server answers again (not left RUNNING for ever)
        self.lost: tuple[str, str] | None = None

    @classmethod
    def start(cls, cfg: TrainConfig, store: Store, run_text: str, warn: Warn) -> Tracker:
        """The run's MLflow run: the one the run dir records (a resume), else a new one with
        the settings as params; a tracker that does nothing without a URI or on failure."""
        tracker = cls(tracking_uri(cfg), store, run_text, warn)
        if tracker.uri is not None:
            tracker._call("start the run", lambda: tracker._open(cfg))
        return tracker

    @property
    def active(self) -> bool:
        return self.run_id is not None

    def _open(self, cfg: TrainConfig) -> None:
        from mlflow.entities import Param  # lazy: an optional extra
        from mlflow.tracking import MlflowClient  # lazy: an optional extra

        client = MlflowClient(tracking_uri=self.uri)
        recorded = self._recorded()
        if recorded is not None:
            run_id = recorded["run_id"]
            client.update_run(run_id, status="RUNNING")
            logged = set(client.get_run(run_id).data.params)
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or EXPERIMENT
            experiment = client.get_experiment_by_name(name)
            experiment_id = (
                experiment.experiment_id if experiment else client.create_experiment(name)
            )
            run_name = self.run_text.rstrip("/").rsplit("/", 1)[-1]
            tags = {"sparknet.run_dir": self.run_text, "mlflow.source.name": "sparknet"}
            run_id = client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
            self.store.write_bytes(
                MLFLOW_RUN, json.dumps({"tracking_uri": self.uri, "run_id": run_id}).encode()
            )
            logged = set()
        params = [Param(k, v) for k, v in _params(cfg).items() if k not in logged]
        for i in range(0, len(params), 100):  # MLflow takes 100 params a batch
            client.log_batch(run_id, params=params[i : i + 100])
        self.client, self.run_id = client, run_id

    def _recorded(self) -> dict[str, str] | None:
        """The MLflow run this run dir records, where it is on this tracking server."""
        try:
            record = json.loads(self.store.read_bytes(MLFLOW_RUN))
        except (MissingObjectError, ValueError):
            return None
        return record if record.get("tracking_uri") == self.uri else None

    def following(
        self, on_round: Callable[[dict[str, Any]], None] | None
    ) -> Callable[[dict[str, Any]], None]:
        """`on_round`, after the round's step is logged."""

        def on_row(row: dict[str, Any]) -> None:
            self.round(row)
            if on_round is not None:
                on_round(row)

        return on_row

    def round(self, row: dict[str, Any]) -> None:
        """A round's numbers as one step (its round number)."""
        if not self.active:
            return
        from mlflow.entities import Metric  # lazy: an optional extra

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, row["round"]) for k, v in _numbers(row).items()]
        self._call("log a round", lambda: self.client.log_batch(self.run_id, metrics=metrics))

    def finish(self, saved: SavedModel) -> None:
        """The run dir's files and the model, then the run marked finished."""
        if self.active:
            self._call("log the run dir and the model", lambda: self._finish(saved))
        self._end_lost()

    def _finish(self, saved: SavedModel) -> None:
        import mlflow  # lazy: an optional extra

        with tempfile.TemporaryDirectory(prefix="sparknet-mlflow-") as tmp:
            files = Path(tmp) / "run_dir"
            files.mkdir()
            for name in ARTIFACTS:
                with contextlib.suppress(MissingObjectError):
                    (files / name).write_bytes(self.store.read_bytes(name))
            self.client.log_artifacts(self.run_id, str(files), artifact_path="run_dir")
            # the module itself (pickle: MLflow's pt2 is traced at the example's batch size,
            # and then takes no other), saved here and logged through this run's client, not
            # MLflow's global active run (a notebook's own run would take it)
            quiet = logging.getLogger("mlflow.pytorch")  # its warning that pickle is pickle
            level = quiet.level
            quiet.setLevel(logging.ERROR)
            try:
                mlflow.pytorch.save_model(
                    saved.build(), str(Path(tmp) / "model"), serialization_format="pickle",
                    pip_requirements=[f"{p}=={version(p)}" for p in ("torch", "torchvision")],
                )  # fmt: skip
            finally:
                quiet.setLevel(level)
            self.client.log_artifacts(self.run_id, str(Path(tmp) / "model"), artifact_path="model")
        self.client.set_terminated(self.run_id, status="FINISHED")

    def stop(self, interrupted: bool) -> None:
        """The run ended without finishing: KILLED (a signal) or FAILED; a resume continues it."""
        if self.active:
            status = "KILLED" if interrupted else "FAILED"
            self._call("end the run", lambda: self.client.set_terminated(self.run_id, status))
        self._end_lost()

    def _end_lost(self) -> None:
        """The MLflow run given up on mid-run, marked FAILED with a tag saying why, where the
        server answers now; silently not where it still does not (the warning was said)."""
        if self.lost is None or self.client is None:
            return
        run_id, why = self.lost
        self.lost = None
        note = f"{why}; every metric is in {self.run_text.rstrip('/')}/metrics.jsonl"
        with contextlib.suppress(Exception), _http_settings():
            self.client.set_tag(run_id, "sparknet.tracking", note)
            self.client.set_terminated(run_id, status="FAILED")

    def _call(self, what: str, call: Callable[[], None]) -> None:
        try:
            with _http_settings():
                call()
        except Exception as exc:  # MLflow raises many kinds; none may stop the training
            if self.run_id is not None:
                self.lost = (self.run_id, f"MLflow failed to {what}: {first_line(exc)}")
            self.run_id = None
            self.warn(
                f"MLflow at {self.uri} failed to {what} ({first_line(exc)}); the run goes on "
                "without it, its metrics in the run dir"
            )


def _http_settings() -> contextlib.AbstractContextManager[None]:
    """`_HTTP` in the environment for a call: MLflow reads its HTTP settings from there as it
    asks; the user's own win."""
    return variables({k: os.environ.get(k) or v for k, v in _HTTP.items()})


def _params(cfg: TrainConfig) -> dict[str, str]:
    """The settings as MLflow params (text of at most 6000 characters; Spark's by key)."""
    settings = cfg.model_dump(mode="json")
    conf = settings.pop("spark_conf", {}) or {}
    out = {k: json.dumps(v) if isinstance(v, list | dict) else str(v) for k, v in settings.items()}
    out.update({f"spark_conf.{k}": str(v) for k, v in conf.items()})  # credentials: refused
    return {k: v[:6000] for k, v in out.items()}


def _numbers(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """A round's row as MLflow metrics: its numbers, nested ones as `seconds.total`."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "round":
            continue
        if isinstance(value, dict):
            out.update(_numbers(value, f"{prefix}{key}."))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
    return out
