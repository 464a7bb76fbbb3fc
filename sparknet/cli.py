"""Command line: `sparknet train` (the main job on one machine), `sparknet data ...` (datasets on
local disk or S3) and `sparknet-submit`."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sparknet.config import (
    find_config_file,
    load_datasets,
    load_train_config,
    read_run_config,
)
from sparknet.errors import SparknetError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console(stderr=True)


@app.callback()
def _root() -> None:
    """sparknet: synchronized local SGD for PyTorch on Apache Spark."""


def _fail(exc: BaseException, debug: bool, code: int = 2) -> None:
    """One line that says what to fix, exit `code`; the traceback only with --debug."""
    if debug:
        raise exc
    print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
    raise typer.Exit(code)


def _fmt(row: dict[str, Any]) -> str:
    acc = f"  acc {row['eval_accuracy']:.3f}" if "eval_accuracy" in row else ""
    return f"loss {row['loss']:.4f}{acc}  {row['samples_per_s']:.0f} samples/s"


def _summary(result) -> Table:
    rows = result.metrics
    last_eval = next((r for r in reversed(rows) if "eval_accuracy" in r), {})
    table = Table(title="sparknet run", show_header=False)
    table.add_row("rounds", str(result.rounds))
    table.add_row("train loss (last round)", f"{result.final['loss']:.4f}")
    if last_eval:
        table.add_row("test loss", f"{last_eval['eval_loss']:.4f}")
        table.add_row("test accuracy", f"{last_eval['eval_accuracy']:.4f}")
        table.add_row("test top-5", f"{last_eval['eval_top5']:.4f}")
    skipped = sum(r.get("skipped_samples", 0) for r in rows)
    if skipped:
        table.add_row("skipped bad samples", str(skipped))
    total = sum(r["seconds"]["total"] for r in rows)
    table.add_row("samples/s (mean)", f"{sum(r['samples'] for r in rows) / total:.0f}")
    table.add_row("wall time", f"{result.final['elapsed_s']:.1f} s")
    table.add_row("run dir", str(result.run_dir))
    return table


@app.command()
def train(
    config: Path | None = typer.Option(
        None, "--config", help="settings YAML (train:, datasets:); default ./sparknet.yaml"
    ),
    set_: list[str] = typer.Option([], "--set", help="key=value, repeatable"),
    model: str | None = typer.Option(None, help="mlp, cnn, a torchvision name, or module:factory"),
    num_classes: int | None = typer.Option(None, help="default: from the dataset"),
    data: str | None = typer.Option(
        None,
        help="digits, module:factory, a name from sparknet.yaml's datasets:, s3://bucket/prefix, "
        "a local dataset dir, parquet:PATH or table:NAME",
    ),
    eval_data: str | None = typer.Option(None, help="parquet:PATH or table:NAME to evaluate on"),
    label_col: str | None = typer.Option(None, help="DataFrame label column (default label)"),
    input_col: str | None = typer.Option(None, help="DataFrame image/features column"),
    image_size: int | None = typer.Option(None, help="train/eval crop size for images"),
    loader_workers: int | None = typer.Option(None, help="decoding processes per Spark task"),
    cache_dir: Path | None = typer.Option(None, help="executor-local shard cache dir"),
    cache_gb: float | None = typer.Option(None, help="shard cache cap (GiB); 0: stream only"),
    endpoint_url: str | None = typer.Option(None, help="S3-compatible endpoint (MinIO, moto)"),
    workers: int | None = typer.Option(None, help="K: Spark partitions, one worker each"),
    tau: int | None = typer.Option(None, help="local steps per round"),
    rounds: int | None = typer.Option(None),
    batch_size: int | None = typer.Option(None, help="per worker"),
    optimizer: str | None = typer.Option(None, help="inner optimizer: sgd or adamw"),
    lr: float | None = typer.Option(None, help="inner learning rate"),
    momentum: float | None = typer.Option(None, help="inner momentum (sgd)"),
    weight_decay: float | None = typer.Option(None),
    outer: str | None = typer.Option(None, help="average (SparkNet) or nesterov (DiLoCo)"),
    outer_lr: float | None = typer.Option(None, help="nesterov only; default 0.7"),
    outer_momentum: float | None = typer.Option(None, help="nesterov only; default 0.9"),
    inner_state: str | None = typer.Option(None, help="keep or reset the inner optimizer state"),
    seed: int | None = typer.Option(None),
    eval_every: int | None = typer.Option(None, help="rounds; 0: only at the end"),
    checkpoint_every: int | None = typer.Option(None, help="rounds; 0: only at the end"),
    out: Path | None = typer.Option(None, help="run dir; default runs/<model>-<data>-<time>"),
    resume: bool = typer.Option(False, help="continue the run in --out from its last checkpoint"),
    master: str | None = typer.Option(None, help="Spark master; default local[<cores>,4]"),
    transport: str | None = typer.Option(None, help="spark"),
    debug: bool = typer.Option(False, help="show tracebacks"),
) -> None:
    """Train a model with synchronized local SGD on Spark and write a run dir."""
    flags = {k: v for k, v in locals().items() if k not in ("config", "set_", "resume", "debug")}
    try:
        base = None
        if resume:
            if out is None:
                raise SparknetError("--resume needs --out, the run dir to continue")
            base = read_run_config(out)
        config = find_config_file(config)
        cfg = load_train_config(config_file=config, sets=set_, flags=flags, base=base)
        datasets = load_datasets(config)
        from sparknet.training.driver import train as run_training

        progress = Progress(
            TextColumn("[bold]round"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
        )
        bar = progress.add_task("train", start=False, info="starting Spark")

        def on_start(done: int, total: int) -> None:
            progress.update(bar, completed=done, total=total)
            progress.start_task(bar)
            progress.start()

        def on_round(row: dict[str, Any]) -> None:
            progress.update(bar, completed=row["round"], info=_fmt(row))

        try:
            result = run_training(
                cfg, resume=resume, on_start=on_start, on_round=on_round, datasets=datasets
            )
        finally:
            progress.stop()
        console.print(_summary(result))
    except SparknetError as exc:
        _fail(exc, debug)
    except KeyboardInterrupt:
        _fail(
            SparknetError("interrupted; Spark stopped, the last complete checkpoint is kept"),
            debug,
            code=130,
        )


data_app = typer.Typer(
    no_args_is_help=True, help="Datasets: shard an ImageNet tree, upload, verify, list."
)
app.add_typer(data_app, name="data")

ConfigOption = typer.Option(None, "--config", help="settings YAML; default ./sparknet.yaml")
EndpointOption = typer.Option(None, help="S3-compatible endpoint (MinIO, moto)")
DatasetArgument = typer.Argument(..., help="dataset dir, s3://bucket/prefix or a name")
DebugOption = typer.Option(False, help="show tracebacks")


def _dataset_uri(name_or_uri: str, config: Path | None, endpoint_url: str | None):
    """A dataset name from `datasets:` or a URI/path as given, with its endpoint."""
    entry = load_datasets(find_config_file(config)).get(name_or_uri)
    if entry is None:
        return name_or_uri, endpoint_url
    return entry.uri, endpoint_url or entry.endpoint_url


def _bytes_progress(description: str) -> Progress:
    from rich.progress import DownloadColumn, TransferSpeedColumn

    return Progress(
        TextColumn(f"[bold]{description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
        console=console,
    )


@data_app.command("shard")
def data_shard(
    src: Path = typer.Argument(..., help="ImageNet tree: train/<wnid>/*.JPEG and val/"),
    dest: Path = typer.Argument(..., help="directory for the shards and manifest.json"),
    shard_mb: int = typer.Option(256, "--shard-mb", min=1, help="target shard size (MiB)"),
    seed: int = typer.Option(0, help="seed of the shuffle that mixes classes across shards"),
    processes: int | None = typer.Option(None, help="default: all cores"),
    debug: bool = DebugOption,
) -> None:
    """Write WebDataset tar shards and manifest.json; a re-run keeps shards already written."""
    from sparknet.data.shards import write_dataset

    try:
        with Progress(
            TextColumn("[bold]shards"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
            console=console,
        ) as progress:  # fmt: skip
            bar = progress.add_task("shard", total=None)

            def on_progress(done: int, total: int) -> None:
                progress.update(bar, completed=done, total=total)

            report = write_dataset(
                src, dest, shard_bytes=shard_mb << 20, seed=seed, processes=processes,
                on_progress=on_progress,
            )  # fmt: skip
    except SparknetError as exc:
        _fail(exc, debug)
    except KeyboardInterrupt:
        _fail(SparknetError("interrupted; run the same command again to resume"), debug, 130)
    m = report.manifest
    splits = ", ".join(f"{k}: {len(v)} shards, {sum(s.samples for s in v)} images"
                       for k, v in m.splits.items())  # fmt: skip
    print(
        f"{dest}: {m.num_classes} classes; {splits}; "
        f"{len(report.written)} written, {len(report.reused)} kept"
    )


@data_app.command("upload")
def data_upload(
    src: Path = typer.Argument(..., help="a dataset dir made by `sparknet data shard`"),
    dest: str = typer.Argument(..., help="s3://bucket/prefix or a name from datasets:"),
    concurrency: int = typer.Option(8, min=1, help="parallel transfers"),
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Upload shards (skipping ones already there), then manifest.json last."""
    from sparknet.data.manifest import MANIFEST_NAME, Manifest
    from sparknet.data.transfer import upload_dataset

    try:
        uri, endpoint = _dataset_uri(dest, config, endpoint_url)
        path = src / MANIFEST_NAME
        if not path.is_file():
            raise SparknetError(f"{src} has no {MANIFEST_NAME}: run `sparknet data shard` first")
        manifest = Manifest.loads(path.read_bytes(), str(path))
        total = sum(s.bytes for v in manifest.splits.values() for s in v)
        with _bytes_progress("upload") as progress:
            bar = progress.add_task("upload", total=total)
            report = upload_dataset(
                src, uri, endpoint_url=endpoint, max_concurrency=concurrency,
                on_progress=lambda n: progress.advance(bar, n),
            )  # fmt: skip
    except SparknetError as exc:
        _fail(exc, debug)
    except KeyboardInterrupt:
        _fail(
            SparknetError("interrupted; no manifest was uploaded, run it again to resume"),
            debug,
            130,
        )
    print(
        f"{uri}: {len(report.uploaded)} shards uploaded "
        f"({report.bytes_uploaded / 2**20:.1f} MiB), {len(report.skipped)} already there"
    )


@data_app.command("verify")
def data_verify(
    uri: str = DatasetArgument,
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Check every shard's size and sha256 against the manifest; exit 1 on any difference."""
    from sparknet.data.transfer import verify_dataset

    try:
        where, endpoint = _dataset_uri(uri, config, endpoint_url)
        with _bytes_progress("verify") as progress:
            bar = progress.add_task("verify", total=None)
            report = verify_dataset(
                where, endpoint_url=endpoint, on_progress=lambda n: progress.advance(bar, n)
            )
    except SparknetError as exc:
        _fail(exc, debug)
    for line in report.problems:
        print(line)
    if not report.ok:
        print(f"error: {len(report.problems)} of {report.checked} shards are bad", file=sys.stderr)
        raise typer.Exit(1)
    print(f"{where}: all {report.checked} shards match the manifest")


@data_app.command("ls")
def data_ls(
    uri: str = DatasetArgument,
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Splits, shards, images and bytes of a dataset."""
    from sparknet.data.transfer import list_dataset

    try:
        where, endpoint = _dataset_uri(uri, config, endpoint_url)
        listing = list_dataset(where, endpoint_url=endpoint)
    except SparknetError as exc:
        _fail(exc, debug)
    table = Table(title=f"{listing.uri} ({listing.num_classes} classes)")
    for col in ("split", "shards", "images", "MiB"):
        table.add_column(col, justify="left" if col == "split" else "right")
    for sp in listing.splits:
        table.add_row(sp.split, str(sp.shards), str(sp.samples), f"{sp.bytes / 2**20:.1f}")
    Console().print(table)
    if listing.missing:
        print(f"error: missing shards: {', '.join(listing.missing)}", file=sys.stderr)
        raise typer.Exit(1)


cluster_app = typer.Typer(no_args_is_help=True, help="EC2 GPU clusters: up, down, status, list.")
app.add_typer(cluster_app, name="cluster")
RegionOption = typer.Option(None, help="AWS region; default: the cluster's, else us-east-1")


def _cluster_spec(name: str, config: Path | None, flags: dict[str, Any]):
    """The spec of cluster `name`: the registry's, else `clusters:` in the settings file, plus
    flags; a one-line error when the result is invalid."""
    from pydantic import ValidationError

    from sparknet.cluster.lifecycle import registered
    from sparknet.cluster.spec import ClusterSpec
    from sparknet.config import describe_validation_error, read_section

    base: dict[str, Any] = {}
    known = registered().get(name)
    if known is not None:
        base = known.model_dump()
    path = find_config_file(config)
    if path is not None:
        base.update(read_section(path, "clusters").get(name) or {})
    base.update({k: v for k, v in flags.items() if v not in (None, [])})
    base["name"] = name
    try:
        return ClusterSpec.model_validate(base)
    except ValidationError as exc:
        raise SparknetError(f"cluster {name}: {describe_validation_error(exc)}") from exc


def _instances_table(info) -> Table:
    table = Table(title=f"cluster {info.name} ({info.region})")
    for col in ("role", "id", "type", "az", "public ip", "spot"):
        table.add_column(col)
    for inst in info.instances:
        table.add_row(
            inst.role,
            inst.id,
            inst.type,
            inst.az,
            inst.public_ip or "-",
            "yes" if inst.spot else "",
        )
    return table


@contextlib.contextmanager
def _interrupt_once(name: str) -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP (`kill`, a closed terminal, a CI timeout) unwind `up` once, so
    it removes what it made instead of dying with instances running; a second signal must not
    cut that clean-up short, so it is only acknowledged."""
    interrupted = False

    def interrupt(signum: int, frame: Any) -> None:
        nonlocal interrupted
        if interrupted:
            console.print(f"still removing what `up` made; `sparknet cluster down {name}` after")
            return
        interrupted = True
        raise KeyboardInterrupt

    wanted = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    before = {sig: signal.signal(sig, interrupt) for sig in wanted}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@cluster_app.command("up")
def cluster_up(
    name: str = typer.Argument(..., help="cluster name (a `clusters:` entry, or new)"),
    workers: int | None = typer.Option(None, help="worker instances"),
    instance_type: list[str] = typer.Option([], help="worker type, repeatable: fallback order"),
    master_type: str | None = typer.Option(None),
    spot: bool | None = typer.Option(None, "--spot/--on-demand", help="workers on spot"),
    region: str | None = RegionOption,
    allowed_cidr: str | None = typer.Option(None, help="SSH source; default: your /32"),
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Bring a cluster up (idempotent); on error or Ctrl-C, remove what was created."""
    from sparknet.cluster import lifecycle

    flags = dict(
        workers=workers, instance_types=instance_type, master_type=master_type, spot=spot,
        region=region, allowed_cidr=allowed_cidr,
    )  # fmt: skip
    try:
        spec = _cluster_spec(name, config, flags)
        with _interrupt_once(name):
            info = lifecycle.up(spec, endpoint_url=endpoint_url, say=console.print)
    except SparknetError as exc:
        _fail(exc, debug)
    Console().print(_instances_table(info))
    price = "unknown" if info.hourly_usd is None else f"${info.hourly_usd:.2f}/hour"
    print(f"cluster {name} is up; estimated cost {price}; `sparknet cluster down {name}` ends it")


def _on_cluster(action, name: str, region: str | None, config: Path | None, debug: bool, **kw):
    """`action(spec, **kw)` for the named cluster; a one-line error and exit 2 on failure."""
    try:
        return action(_cluster_spec(name, config, {"region": region}), **kw)
    except SparknetError as exc:
        _fail(exc, debug)


@cluster_app.command("down")
def cluster_down(
    name: str = typer.Argument(...),
    region: str | None = RegionOption,
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Terminate the cluster's instances, delete its resources, and list what was deleted."""
    from sparknet.cluster import lifecycle

    report = _on_cluster(
        lifecycle.down, name, region, config, debug, endpoint_url=endpoint_url, say=console.print
    )
    for item in report.terminated:
        print(f"terminated instance:{item}")
    for item in report.deleted:
        print(f"deleted {item}")
    cost = "unknown" if report.cost_usd is None else f"${report.cost_usd:.2f}"
    print(f"cluster {name} is down; its instances cost about {cost}")


@cluster_app.command("status")
def cluster_status(
    name: str = typer.Argument(...),
    region: str | None = RegionOption,
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """The cluster's instances, found by tag; exit 1 when it has none."""
    from sparknet.cluster import lifecycle

    info = _on_cluster(lifecycle.status, name, region, config, debug, endpoint_url=endpoint_url)
    if not info.instances:
        print(f"cluster {name} has no live instances in {info.region}")
        raise typer.Exit(1)
    Console().print(_instances_table(info))
    if info.hourly_usd is not None:
        print(f"estimated cost ${info.hourly_usd:.2f}/hour")


@cluster_app.command("list")
def cluster_list(
    region: str = typer.Option("us-east-1"),
    endpoint_url: str | None = EndpointOption,
    debug: bool = DebugOption,
) -> None:
    """Clusters with resources in the region (by tag), and whether this machine knows them."""
    from sparknet import aws
    from sparknet.cluster import lifecycle

    try:
        found = lifecycle.tagged_resources(aws.check_region(region), endpoint_url=endpoint_url)
    except SparknetError as exc:
        _fail(exc, debug)
    known = lifecycle.registered()
    for name in sorted(set(found) | set(known)):
        items = found.get(name, [])
        live = sum(item.startswith("instance:") for item in items)
        where = "registered" if name in known else "not registered"
        print(f"{name}\t{live} instances\t{len(items) - live} other resources\t{where}")


@cluster_app.command("sweep")
def cluster_sweep(
    region: str = typer.Option("us-east-1"),
    yes: bool = typer.Option(False, "--yes", help="take them down; default: only list"),
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Tagged resources of clusters neither registered here nor in `clusters:`; `--yes` deletes
    them (the bucket is kept)."""
    from sparknet import aws
    from sparknet.cluster import lifecycle
    from sparknet.config import read_section

    try:
        path = find_config_file(config)
        wanted = set(lifecycle.registered())
        if path is not None:
            wanted |= set(read_section(path, "clusters"))
        found = lifecycle.orphans(aws.check_region(region), wanted, endpoint_url=endpoint_url)
        for name, items in sorted(found.items()):
            print(f"orphan {name}: {' '.join(items)}")
            if yes:
                spec = _cluster_spec(name, config, {"region": region})
                lifecycle.down(spec, endpoint_url=endpoint_url, say=console.print)
                print(f"took {name} down")
        if found and not yes:
            print("run again with --yes to delete them")
    except SparknetError as exc:
        _fail(exc, debug)


submit_app = typer.Typer(add_completion=False, help="Run a training job on an EC2 GPU cluster.")


@submit_app.command()
def submit(
    s3: str = typer.Option(
        ..., "--s3", help="dataset name from sparknet.yaml or s3://bucket/prefix"
    ),
) -> None:
    """Submit a job to a cluster (needs the cluster support, which this version does not have)."""
    _fail(
        SparknetError(
            "sparknet-submit: cluster support is not in this version yet; "
            "use `sparknet train` to run locally"
        ),
        debug=False,
    )


def main() -> None:
    # `package.module:factory` resolves against the current directory, as with `python -m`
    # (and as Spark's Python workers, started with -m, already do).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    app()


def submit_main() -> None:
    submit_app()
