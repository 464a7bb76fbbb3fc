"""A run dir, local or on S3: what may be in it, what a run may do with it, and who holds it.

Every file of a run goes through the same `Store` the data code reads with, so a local dir and an
`s3://bucket/prefix/RUN` behave alike. Locking differs: locally `flock` on the dir (the kernel
drops it with the process); S3 has no locks, so a lock object made with a conditional PUT
(`If-None-Match: *`: only one creator wins) holds the owner, is renewed by a heartbeat, and is
taken over once its heartbeat is older than `STALE_S` (a run that died without removing it).
"""

from __future__ import annotations

import contextlib
import email.utils
import fcntl
import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import botocore.exceptions as bx

from sparknet.config import TrainConfig, yaml_section
from sparknet.data import s3
from sparknet.data.s3 import S3Uri
from sparknet.data.store import MissingObjectError, S3Store, Store, open_store
from sparknet.errors import SettingError, SparknetError
from sparknet.training import checkpoint
from sparknet.training.report import CURVES, METRICS
from sparknet.training.retention import BEST

MODEL_FILE = "model.safetensors"
#: what the model is (`saved_model`): its name, outputs and input, for loading it from the dir
MODEL_INFO = "model.json"
CONFIG_FILE = "config.yaml"
#: the S3 lock object (a local run dir is locked with flock and holds no such file)
LOCK = ".sparknet-lock"
#: a lock not renewed for this long belongs to a run that is gone and is taken over
STALE_S = 300.0
#: how often a held lock is renewed
HEARTBEAT_S = 30.0
#: a run whose renewals have all failed for this long counts its lock as lost (well before
#: another run may take it over as stale)
LOST_AFTER_S = STALE_S / 2

#: where `sparknet evaluate` reports into a run dir, and `sparknet export` writes, by default
EVALUATIONS = "evaluations"
EXPORTED_TORCHSCRIPT, EXPORTED_PROGRAM = "model.torchscript.pt", "model.pt2"
#: the run's MLflow run (training/tracking.py)
MLFLOW_RUN = "mlflow.json"
#: what a run writes into its dir; anything else there is not a run's
RUN_ENTRIES = {
    CONFIG_FILE,
    METRICS,
    checkpoint.CHECKPOINTS,
    BEST,
    MODEL_FILE,
    MODEL_INFO,
    CURVES,
    LOCK,
    EVALUATIONS,
}
#: the start of the token a driver puts in a local run dir for its executors to read
#: (rundir_reach); removed at once, but a driver killed meanwhile leaves it: then ignored
REACH_TOKEN = ".sparknet-reach."
#: temp names of the files above (the store's `.NAME.<pid>.<hex>.tmp`, and older versions'),
#: and TensorBoard's event files
_RUN_EXTRAS = re.compile(
    r"^\.(config\.yaml|metrics\.jsonl|model\.safetensors|model\.json|curves\.png|mlflow\.json|best\.json)(\..+)?\.tmp(\.png)?$"
    r"|^events\.out\.tfevents\."
)


class StoredSettings(dict[str, Any]):
    """A stored run's `train:` settings, and the file they were read from (`where`): a value
    there that no longer validates is named with its file (`load_train_config`)."""

    def __init__(self, section: dict[str, Any], where: str) -> None:
        super().__init__(section)
        self.where = where


def read_run_config(run_dir: str | Path, endpoint_url: str | None = None) -> StoredSettings:
    """The `train:` section of the settings a `--resume` continues: those its newest complete
    checkpoint was made with (the run dir's `config.yaml` may already hold the changes of an
    `--allow-change` resume that was interrupted before its first checkpoint). `run_dir` is a
    local dir or an s3:// URI."""
    section = _stored(open_store(str(run_dir), endpoint_url), str(run_dir))
    # the transport that ran is the run's record, not a setting to keep: unless the resume
    # names one, `auto` decides again where it runs now (keeping `allreduce` where it can:
    # `ran_transport`)
    section.pop("transport", None)
    return StoredSettings(_as_it_ran(section), section.where)


def _stored(store: Store, run_dir: str) -> StoredSettings:
    """The `train:` section of the newest complete checkpoint's config.yaml, else (no
    checkpoint, or it lost that file) of the run dir's."""
    last = checkpoint.latest(store)
    names = [f"{checkpoint.name(last)}/{checkpoint.CONFIG}"] if last is not None else []
    for name in [*names, CONFIG_FILE]:
        try:
            data = store.read_bytes(name)
        except MissingObjectError:
            continue
        where = f"{run_dir}/{name}"
        try:
            text = data.decode()
        except UnicodeDecodeError as exc:
            raise SparknetError(
                f"config file {where} is not UTF-8 text (byte {exc.start}); save it as UTF-8"
            ) from exc
        return StoredSettings(yaml_section(text, where, "train"), where)
    raise SparknetError(f"{run_dir} has no config.yaml: it is not a sparknet run dir")


#: settings added since a run dir could have been written, at the values such a run ran with
#: where today's default differs: its chooser's bound before `tau_max` came (under tau auto)
_BEFORE_THEY_CAME = {"tau_max": 1000}
#: the same for every run: its checkpoints were all kept (a resume deletes none unasked)
_BEFORE_THEY_CAME_ALL = {"keep_checkpoints": 0}


def _as_it_ran(section: dict[str, Any]) -> dict[str, Any]:
    """A stored run's settings with those it predates filled in as it ran: a resume of it
    then goes on as it would have (the stored value of a setting is what a resume compares)."""
    before = dict(_BEFORE_THEY_CAME_ALL)
    if section.get("tau") == "auto":
        before.update(_BEFORE_THEY_CAME)
    return _schedule_as_recorded(
        {**{k: v for k, v in before.items() if k not in section}, **section}
    )


def _schedule_as_recorded(section: dict[str, Any]) -> dict[str, Any]:
    """A stored run's schedule settings as they are recorded now: an older config.yaml holds
    `lr_gamma` and `lr_unit` under schedules that use neither (their defaults, which did
    nothing), and its outer cosine decayed over `lr_decay_length` (in rounds: now its own
    `outer_lr_decay_rounds`; an inner schedule other than cosine then has no length)."""
    out = dict(section)
    schedule = out.get("lr_schedule", "constant")
    older = "outer_lr_decay_rounds" not in out and out.get("outer_lr_schedule") == "cosine"
    if older and out.get("lr_unit", "rounds") == "rounds":
        out["outer_lr_decay_rounds"] = out.get("lr_decay_length")
    if schedule != "cosine":
        out.pop("lr_decay_length", None)
    if schedule not in ("step", "multistep"):
        out.pop("lr_gamma", None)
    if schedule == "constant":
        out.pop("lr_unit", None)
    return out


def ran_transport(store: Store) -> str | None:
    """The transport a resumed run last ran on, from the settings its resume continues
    (`read_run_config`'s file): a resume under `auto` keeps `allreduce` where it can run, so
    that the resumed run is bit for bit the one that never stopped. None where none is
    recorded."""
    try:
        ran = _stored(store, store.uri).get("transport")
    except SparknetError:
        return None  # the resume's own reading of the same file says what is wrong with it
    return ran if ran in ("spark", "allreduce") else None


def is_run_entry(name: str) -> bool:
    return name in RUN_ENTRIES or bool(_RUN_EXTRAS.match(name))


@dataclass(frozen=True)
class RunDir:
    """Where a run writes: `text` as the user gave it (for messages), `store` to write through."""

    text: str
    store: Store

    @classmethod
    def open(cls, out: str, endpoint_url: str | None = None) -> RunDir:
        """The run dir of `--out`; a local path or s3://bucket/prefix (refused: the bucket
        itself, or any other scheme)."""
        if out.startswith("s3://"):
            if not S3Uri.parse(out).key.strip("/"):
                raise SettingError(
                    "{@out=value}: a run needs its own prefix; write it as s3://BUCKET/PREFIX/RUN",
                    setting="out",
                    value=out,
                )
            return cls(out, open_store(out, endpoint_url))
        if "://" in out:
            raise SettingError(
                "{@out=value}: write a local path or s3://BUCKET/PREFIX/RUN",
                setting="out", value=out,
            )  # fmt: skip
        path = str(Path(out).expanduser())  # as the store reads it, so the lock is on that dir
        return cls(path, open_store(path))

    @property
    def on_s3(self) -> bool:
        return isinstance(self.store, S3Store)

    @property
    def local(self) -> Path:
        """The local dir (only for a local run dir)."""
        assert not self.on_s3
        return Path(self.text)

    @property
    def result(self) -> Path | str:
        """What `RunResult.run_dir` is: a Path for a local dir, the URI for S3."""
        return self.store.uri if self.on_s3 else Path(self.text)

    def child(self, name: str) -> str:
        """A file of the run, for messages."""
        return f"{self}/{name}"

    def __str__(self) -> str:
        return self.store.uri if self.on_s3 else self.text


# ---- checks ----------------------------------------------------------------------------------


def check_out(run: RunDir) -> None:
    """A local --out must be (or become) a directory: neither it nor a parent may be a file; an
    S3 --out must not be an object's key (a file there)."""
    if run.on_s3:
        assert isinstance(run.store, S3Store)
        if _is_object(run.store):
            raise SettingError(
                "{@out=value}: that is an object (a file) in S3; choose a prefix for the run",
                setting="out",
                value=str(run),
            )
        return
    for path in (run.local, *run.local.parents):
        if path.exists() and not path.is_dir():
            raise SettingError(
                "{@out=value}: {path} is a file; choose a directory for the run",
                setting="out", value=str(run.local), path=path,
            )  # fmt: skip


def _is_object(store: S3Store) -> bool:
    """Whether an object exists at the store's own key. Any failure reads as no: the lock's
    first request then says what is wrong in its own words."""
    where = S3Uri.parse(store.uri)
    s3.check_reachable(where, store.endpoint_url)
    with contextlib.suppress(bx.BotoCoreError, bx.ClientError):
        store._client().head_object(Bucket=where.bucket, Key=where.key)
        return True
    return False


def _is_unfinished_run(run: RunDir, entries: set[str]) -> bool:
    """A sparknet run dir whose run ended before its first complete checkpoint: its config
    parses as a run's, nothing but a run's files is there, and there is nothing to resume."""
    if not all(is_run_entry(e) for e in entries):
        return False
    try:
        TrainConfig(**read_run_config(run.text, getattr(run.store, "endpoint_url", None)))
    except (SparknetError, ValueError, TypeError):
        return False
    return checkpoint.latest(run.store) is None


def check(run: RunDir, resume: bool) -> None:
    """Refuse a run dir that cannot be used as asked.

    A dir whose run ended before its first complete checkpoint holds nothing to resume, so a new
    run may start over in it (without --resume); a dir of anything else is never overwritten."""
    entries = {e for e in run.store.entries() - {LOCK} if not e.startswith(REACH_TOKEN)}
    if resume:
        if CONFIG_FILE not in entries:
            raise SparknetError(f"nothing to resume: {run} is not a sparknet run dir")
    elif entries and not _is_unfinished_run(run, entries):
        if CONFIG_FILE in entries and all(is_run_entry(e) for e in entries):
            raise SettingError(
                "{value} already holds a run; pass {@resume=True} to continue it or choose "
                "another {@out}",
                setting="out",
                value=str(run),
            )
        raise SettingError(
            "{@out=value} is not empty and is not a sparknet run dir; choose another {@out}",
            setting="out",
            value=str(run),
        )


# ---- locks -----------------------------------------------------------------------------------


class Lock:
    """What a held run dir offers the round loop: `check` raises once the lock is lost."""

    def check(self) -> None:
        pass


@contextlib.contextmanager
def locked(run: RunDir) -> Iterator[Lock]:
    """Hold the run dir for this run: a second run with the same --out refuses at once, before
    writing anything, instead of mixing its files into the first one's."""
    if run.on_s3:
        assert isinstance(run.store, S3Store)
        lock = S3Lock(run.store)
        lock.acquire()
        try:
            with _guarded(run, lock):
                yield lock
        finally:
            lock.release()
    else:
        with _flocked(run.local):
            yield Lock()


@contextlib.contextmanager
def _guarded(run: RunDir, lock: Lock) -> Iterator[None]:
    """Every write and delete through the run's store checks the lock first: a run that lost
    it stops before its next file instead of mixing it into the run that took the dir over."""
    run.store.guard = lock.check  # type: ignore[attr-defined]
    try:
        yield
    finally:
        run.store.guard = None  # type: ignore[attr-defined]


@contextlib.contextmanager
def _flocked(run_dir: Path) -> Iterator[None]:
    """`flock` on the dir itself (no lock file to leave behind; the kernel drops it when the
    process dies). The dirs made here (the run dir and missing parents) are removed again while
    empty."""
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise SettingError(
            "{@out=value}: cannot create it: {reason}",
            setting="out", value=str(run_dir), reason=exc.strerror,
        ) from exc  # fmt: skip
    try:
        if not os.access(run_dir, os.W_OK):
            raise SettingError(
                "{@out=value}: not writable; choose another {@out}",
                setting="out", value=str(run_dir),
            )  # fmt: skip
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise SparknetError(
                "another sparknet run is using {dir}; wait for it to end or choose another {@out}",
                dir=run_dir,
            ) from exc
        yield
    finally:
        os.close(fd)
        for path in made:  # deepest first; rmdir refuses a dir that is not empty
            with contextlib.suppress(OSError):
                path.rmdir()


def _code(exc: bx.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


#: a conditional write that lost: the object exists (412), or another write raced it (409)
_LOST = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}


class S3Lock(Lock):
    """`<run>/.sparknet-lock`: created only when absent (`If-None-Match: *`), renewed every
    `HEARTBEAT_S` by a thread with `If-Match` on its own ETag (so a renewal never overwrites a
    lock another run took over), removed at the end the same way. Its age is read against the
    S3 server's own clock (the `Date` of the answer), so clocks of the machines do not matter."""

    def __init__(self, store: S3Store) -> None:
        self.store = store
        self.where = store.object_uri(LOCK)
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self.token = uuid.uuid4().hex  # the ETag is the body's MD5: each write must differ
        self.renewals = 0
        self.etag: str | None = None
        self.lost = False
        #: when the last write of the lock that S3 accepted was sent (time.monotonic)
        self.written_at = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _put(self, **condition: str) -> str:
        sent = time.monotonic()
        body = json.dumps(
            {"owner": self.owner, "token": self.token, "renewal": self.renewals,
             "renewed_every_s": HEARTBEAT_S}
        ).encode()  # fmt: skip
        answer = self.store._client().put_object(
            Bucket=self.where.bucket, Key=self.where.key, Body=body, **condition
        )
        self.written_at = sent
        return answer["ETag"]

    def acquire(self) -> None:
        s3.check_reachable(self.where, self.store.endpoint_url)
        try:
            try:
                self.etag = self._put(IfNoneMatch="*")
            except bx.ClientError as exc:
                if _code(exc) not in _LOST:
                    raise
                held = self._read()
                if _token(held) == self.token:  # ours: an answer lost and the PUT retried
                    self.etag = held["ETag"]
                else:
                    self._take_over(held)
        except (bx.BotoCoreError, bx.ClientError) as exc:
            raise s3.describe_client_error(exc, self.store.uri) from exc
        self._thread = threading.Thread(target=self._beat, name="sparknet-lock", daemon=True)
        self._thread.start()

    def _read(self) -> dict[str, Any]:
        """The lock object as it is now: its GetObject answer, the body parsed into `body`."""
        got = self.store._client().get_object(Bucket=self.where.bucket, Key=self.where.key)
        try:
            body = json.loads(got["Body"].read())
        except ValueError:
            body = {}
        return {**got, "body": body if isinstance(body, dict) else {}}

    def _take_over(self, held: dict[str, Any]) -> None:
        """Take over a lock whose run is gone: not renewed for `STALE_S`, or held by a process
        of this host that no longer exists (a kill -9)."""
        age = _age_s(held)
        owner = str(held["body"].get("owner", ""))
        if age < STALE_S and not _dead_here(owner):
            raise self._busy(owner, age)
        try:
            self.etag = self._put(IfMatch=held["ETag"])
        except bx.ClientError as exc:
            if _code(exc) in _LOST:  # another run took it over first
                raise self._busy(owner, 0.0) from exc
            raise

    def _busy(self, owner: str, age: float) -> SparknetError:
        who = f" ({owner})" if owner else ""
        return SparknetError(
            "another sparknet run{who} is using {uri}: its lock {lock} was renewed {age} s ago; "
            "wait for it to end or choose another {@out} (the lock expires {left} s after its "
            "last renewal; if that run is surely gone, delete {lock} to take the dir now)",
            who=who, uri=self.store.uri, lock=self.where, age=f"{age:.0f}",
            left=f"{max(0.0, STALE_S - age):.0f}",
        )  # fmt: skip

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.renew()

    def renew(self) -> None:
        """Rewrite the lock (a new Last-Modified); a failure other than losing it is retried at
        the next beat."""
        if self.lost or self.etag is None:
            return
        self.renewals += 1
        sent = time.monotonic()
        try:
            self.etag = self._put(IfMatch=self.etag)
        except bx.ClientError as exc:
            if _code(exc) in ("NoSuchKey", "404"):
                self.lost = True
            elif _code(exc) in _LOST:
                self._recheck(sent)
        except bx.BotoCoreError:
            pass  # no answer (a dropped connection): the next beat tries again

    def _recheck(self, sent: float) -> None:
        """A conditional renewal lost: still ours when the object holds our token (an answer
        lost and the PUT retried by the client, so our ETag is an old one); else lost."""
        try:
            held = self._read()
        except bx.ClientError as exc:  # gone: 404, or 403 and a list of the key finds nothing
            err = s3.describe_read_error(exc, self.where, self.store._client())
            self.lost = isinstance(err, MissingObjectError)
            return
        except bx.BotoCoreError:
            return
        if _token(held) == self.token:
            self.etag = held["ETag"]
            self.written_at = sent
        else:
            self.lost = True

    def check(self) -> None:
        silent = time.monotonic() - self.written_at
        if not self.lost and silent > LOST_AFTER_S:
            self.lost = True
            raise SparknetError(
                "this run could not renew its lock on {uri} for {silent} s, so another run may "
                "take the dir over; it stops so the two do not mix their files (check the "
                "connection to S3, then resume it with {@resume=True})",
                uri=self.store.uri,
                silent=f"{silent:.0f}",
            )
        if self.lost:
            raise SparknetError(
                f"this run lost its lock on {self.store.uri} (another run took it over or removed "
                f"{self.where}); it stops so the two do not mix their files"
            )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.etag is None or self.lost:
            return
        with contextlib.suppress(bx.BotoCoreError, bx.ClientError):  # a stale lock is taken over
            self.store._client().delete_object(
                Bucket=self.where.bucket, Key=self.where.key, IfMatch=self.etag
            )


def _token(held: dict[str, Any]) -> str | None:
    return held["body"].get("token")


def _dead_here(owner: str) -> bool:
    """Whether `owner` ("host:pid") is a process of this host that no longer exists."""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    return False


def _age_s(head: dict[str, Any]) -> float:
    """Seconds since the object was last written, by the S3 server's clock when it says."""
    date = head.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    now = email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()
    return now - head["LastModified"].timestamp()
