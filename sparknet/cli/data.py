"""`sparknet data ...`: shard an ImageNet tree, upload, verify and list datasets."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from sparknet.cli.common import (
    ConfigOption,
    DebugOption,
    EndpointOption,
    console,
    fail,
    sized,
)
from sparknet.config import find_config_file, load_datasets
from sparknet.errors import SparknetError, no_such_directory

# `# lazy: X` below: an import kept inside the command that needs it, X being slow to import
# (torch ~2 s; boto3, fabric, numpy ~0.2 s each; `+N ms`: what it adds, measured) while
# `sparknet --help` and every other command import this module

data_app = typer.Typer(
    no_args_is_help=True, help="Datasets: shard an ImageNet tree, upload, verify, list."
)

DatasetArgument = typer.Argument(..., help="dataset dir, s3://bucket/prefix or a name")


def _dataset_uri(name_or_uri: str, config: Path | None, endpoint_url: str | None):
    """A dataset name from `datasets:` or a URI/path as given, with its endpoint."""
    entry = load_datasets(find_config_file(config)).get(name_or_uri)
    if entry is None:
        return name_or_uri, endpoint_url
    return entry.uri, endpoint_url or entry.endpoint_url


def _check_dir(given: str) -> Path:
    """A local dataset or source directory, as a Path; one that is not there is one line that
    names it as the user wrote it (`./x`, not `x` or `/home/.../x`)."""
    path = Path(given).expanduser()
    if not path.exists():
        raise no_such_directory(given)
    if not path.is_dir():
        raise SparknetError("{path} is not a directory: give the dataset's directory", path=given)
    return path


def _check_dataset(where: str) -> None:
    """What `data ls` and `data verify` read: a shard dataset (a directory, s3:// or file://);
    a DataFrame spec or a local path that is not there is one line now."""
    if where.startswith(("parquet:", "table:")):
        raise SparknetError(
            "{where} is a DataFrame, not a shard dataset: data ls and data verify read the "
            "datasets `sparknet data shard` writes (a directory or s3://bucket/prefix); "
            "parquet: and table: are for the --data of train, evaluate and predict",
            where=where,
        )
    if "://" not in where:
        _check_dir(where)


#: the `sparknet:cluster` tag of a bucket `data upload --create-bucket` made, which no cluster
#: owns: `cluster up` holds a bucket tagged so to the foundation's settings, as it does its own
BUCKET_MAKER = "data-upload"


def _upload_target(uri: str, region: str | None, create_bucket: bool) -> tuple[str, str | None]:
    """The bucket of an s3:// upload URI and, with `create_bucket`, the region to make it in
    (--region, else the AWS configuration's, else us-east-1): a bucket to make whose name S3
    refuses (by its rules for new buckets), or a region AWS does not have, is one line now,
    before any AWS call."""
    from sparknet import aws  # lazy: boto3
    from sparknet.data.s3 import S3Uri  # lazy: boto3

    if not uri.startswith("s3://"):
        if create_bucket:
            raise SparknetError(f"--create-bucket makes the bucket of an s3:// URI, not {uri!r}")
        return "", None
    bucket = S3Uri.parse(uri).bucket
    if create_bucket:  # a bucket there already may have an older name S3 once allowed (A_b)
        try:
            aws.check_bucket_name(bucket)
        except ValueError as exc:
            raise SparknetError(f"{exc}; fix the URI ({uri})") from None
    configured = aws.session().region_name  # what the upload's own S3 client is made for
    if configured:
        aws.check_region(configured)
    if not create_bucket:
        return bucket, None
    return bucket, aws.check_region(region or configured or "us-east-1")


def _make_bucket(bucket: str, where: str, endpoint_url: str | None) -> list[str]:
    """Make `bucket` in `where` with the cluster foundation's own code (encrypted, never public,
    TLS only, versioned, as `cluster up` makes it; one it made before is held to them again, a
    user's own left as it is); the lines that say which, where it is, and, over plain http, that
    it has no TLS-only policy."""
    from sparknet.cluster.aws.boto3_foundation import Boto3Foundation  # lazy: boto3
    from sparknet.cluster.aws.owner import caller_owner  # lazy: boto3
    from sparknet.cluster.spec import ClusterSpec  # lazy: +30 ms to `sparknet --help`

    spec = ClusterSpec(
        name=BUCKET_MAKER, region=where, bucket=bucket, owner=caller_owner(where, endpoint_url)
    )
    foundation = Boto3Foundation(spec, endpoint_url)
    plain = foundation.plain_http
    foundation.tls_only = not plain  # over http, the TLS-only policy would lock this tool out
    state = foundation.bucket(bucket)
    if state.made:
        lines = [f"bucket {bucket}: made in {where}"]
    elif state.region is not None and state.region != where:
        lines = [
            f"bucket {bucket}: there already, in {state.region}, not {where}: a cluster in "
            f"{where} would read it across regions"
        ]
    else:
        lines = [f"bucket {bucket}: there already, in {state.region or where}"]
    if plain and state.sparknet:
        lines.append(
            f"note: {foundation.s3.meta.endpoint_url} is plain http, so bucket {bucket} has no "
            "TLS-only policy (it would refuse this tool's own requests); it has every other "
            "setting"
        )
    return lines


def _bytes_progress(description: str) -> Progress:
    """A bytes bar on stderr; none without a terminal (a log would keep only its last frame)."""
    return Progress(
        TextColumn(f"[bold]{description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
    )


class _ImagesPerSecond(ProgressColumn):
    """images/s over rich's recent window (the whole phase of a resumed run would count the
    images it took from the last run at thousands per second)."""

    def render(self, task) -> Text:
        return Text(f"{task.speed:,.0f} images/s" if task.speed else "")


#: seconds between progress lines when stderr is not a terminal (a log keeps each line)
LOG_EVERY_S = 60.0


class _ShardProgress:
    """The `data shard` progress: a bar per phase (images, images/s, ETA) on a terminal, else a
    line per phase every LOG_EVERY_S seconds, so a run under nohup shows it is alive."""

    def __init__(self) -> None:
        self.bar = Progress(
            TextColumn("[bold]{task.description:<5}"), MofNCompleteColumn(), BarColumn(),
            _ImagesPerSecond(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
            console=console, disable=not console.is_terminal,
        )  # fmt: skip
        self.tasks: dict[str, TaskID] = {}
        self.logged: dict[str, tuple[float, int]] = {}

    def __enter__(self) -> _ShardProgress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase not in self.tasks:
            self.tasks[phase] = self.bar.add_task(phase, total=total)
        self.bar.update(self.tasks[phase], completed=done, total=total)
        if console.is_terminal:
            return
        now = time.monotonic()
        if phase not in self.logged:  # where it starts: a resumed run has checked some already
            self.logged[phase] = (now, done)
            print(f"{phase}: {done}/{total} images", file=sys.stderr)
            return
        start, start_done = self.logged[phase]
        if done < total and now - start < LOG_EVERY_S:
            return
        rate = (done - start_done) / max(now - start, 1e-9)
        eta = f", eta {_duration((total - done) / rate)}" if rate > 0 and done < total else ""
        print(f"{phase}: {done}/{total} images, {rate:,.0f} images/s{eta}", file=sys.stderr)
        self.logged[phase] = (now, done)


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{max(minutes, 1)}m"


@data_app.command("shard")
def data_shard(
    src: str = typer.Argument(
        ..., help="ImageNet: train/<wnid>/*.JPEG and val/, or the dir of the downloaded tars"
    ),
    dest: str = typer.Argument(
        ..., help="local directory for the shards and manifest.json (then `data upload` it)"
    ),
    shard_mb: int | None = typer.Option(
        None, "--shard-mb", min=1, help="target shard size in MiB (default: 256)"
    ),
    shards: int | None = typer.Option(
        None,
        "--shards",
        min=1,
        help="cut each split into N shards, whatever their size (instead of --shard-mb): a "
        "dataset under 1 MiB can still give every worker a shard",
    ),
    val_fraction: float | None = typer.Option(
        None,
        "--val-fraction",
        help="hold out this share of each class's images as val (seeded by --seed), for a "
        "source without val: a plain ImageFolder root of class folders, or train/ alone",
    ),
    seed: int = typer.Option(
        0, help="seed of the shuffle that mixes classes across shards (and of --val-fraction)"
    ),
    processes: int | None = typer.Option(
        None,
        min=1,
        help="processes that decode-check and write; default: every core, threads for a "
        "source under 10,000 images, processes for a bigger one",
    ),
    classes: str | None = typer.Option(
        None, help="keep only these classes: a file of wnids (one a line) or wnid,wnid,..."
    ),
    max_side: int | None = typer.Option(
        None,
        "--max-side",
        min=32,
        max=65500,
        help="store images shrunk so the longer side is at most this",
    ),
    quality: int | None = typer.Option(
        None, min=1, max=100, help="JPEG quality of shrunk images, with --max-side (default: 90)"
    ),
    debug: bool = DebugOption,
) -> None:
    """Write WebDataset tar shards and manifest.json; a re-run keeps shards already written."""
    from sparknet.data.imagenet import read_class_list  # lazy: +10 ms to `sparknet --help`
    from sparknet.data.shard_plan import DEFAULT_QUALITY, Resize  # lazy: numpy
    from sparknet.data.shards import DEFAULT_SHARD_BYTES, write_dataset  # lazy: PIL

    try:
        if dest.startswith("s3://"):
            raise SparknetError(
                f"{dest}: data shard writes to a local directory; shard there, then "
                f"`sparknet data upload DIR {dest}`"
            )
        source = _check_dir(src)
        wanted = read_class_list(classes) if classes is not None else None
        if quality is not None and max_side is None:
            raise SparknetError("--quality is the quality of images --max-side shrinks: add it")
        if shards is not None and shard_mb is not None:
            raise SparknetError("--shards and --shard-mb both size the shards: give one")
        resize = Resize(max_side, quality or DEFAULT_QUALITY) if max_side is not None else None
        with _ShardProgress() as progress:
            report = write_dataset(
                source, Path(dest), shard_bytes=shard_mb << 20 if shard_mb else DEFAULT_SHARD_BYTES,
                seed=seed, processes=processes, classes=wanted, resize=resize,
                on_progress=progress, shards=shards, val_fraction=val_fraction,
            )  # fmt: skip
    except SparknetError as exc:
        fail(exc, debug)
    except KeyboardInterrupt:
        fail(SparknetError("interrupted; run the same command again to resume"), debug, 130)
    m = report.manifest
    splits = ", ".join(f"{k}: {len(v)} shards, {sum(s.samples for s in v)} images"
                       for k, v in m.splits.items())  # fmt: skip
    removed = f", {len(report.removed)} old removed" if report.removed else ""
    subset = f" (of {m.subset_of}, indexed 0..{m.num_classes - 1})" if m.subset_of else ""
    held = (
        f" (val: {m.held_out.fraction:g} of each class held out of train, seed {m.held_out.seed})"
        if m.held_out is not None
        else ""
    )
    print(
        f"{dest}: {m.num_classes} classes{subset}; {splits}{held}; "
        f"{len(report.written)} written, {len(report.reused)} kept{removed}"
    )
    if report.other_classes_val:
        print(f"{report.other_classes_val} val images of other classes were left out")
    _print_rejected(report.rejected, source, Path(dest), "images do not decode and were left out")
    _print_rejected(report.skipped, source, Path(dest), "files are not .JPEG/.jpg and were skipped")
    for warning in report.warnings:
        print(warning, file=sys.stderr)


#: rejected images named one per line in the summary; the rest are in the manifest
SHOWN_REJECTS = 10


def _print_rejected(rejected: list, src: Path, dest: Path, what: str) -> None:
    """Name the files left out (all are in the manifest, by their path relative to `src`)."""
    if not rejected:
        return
    print(f"{len(rejected)} {what} (listed in {dest}/manifest.json):")
    for r in rejected[:SHOWN_REJECTS]:
        print(f"  {src / r.path}: {r.reason}")
    if len(rejected) > SHOWN_REJECTS:
        print(f"  ... and {len(rejected) - SHOWN_REJECTS} more")


@data_app.command("upload")
def data_upload(
    src: str = typer.Argument(..., help="a dataset dir made by `sparknet data shard`"),
    dest: str = typer.Argument(..., help="s3://bucket/prefix or a name from datasets:"),
    concurrency: int = typer.Option(8, min=1, help="parallel transfers"),
    force: bool = typer.Option(False, "--force", help="send every shard, even ones already there"),
    create_bucket: bool = typer.Option(
        False,
        "--create-bucket",
        help="make the bucket when it is missing, as `sparknet cluster up` makes it: encrypted, "
        "never public, TLS only, versioned (a bucket of your own that is there is left as it is)",
    ),
    region: str | None = typer.Option(
        None,
        help="the region --create-bucket makes it in; default: AWS's configured, else us-east-1",
    ),
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Upload shards (skipping ones already there with the same bytes), then manifest.json last."""
    from sparknet.data.manifest import MANIFEST_NAME, Manifest  # lazy: +7 ms to `sparknet --help`
    from sparknet.data.transfer import upload_dataset  # lazy: boto3, PIL

    try:
        uri, endpoint = _dataset_uri(dest, config, endpoint_url)
        if region is not None and not create_bucket:
            raise SparknetError("--region is where --create-bucket makes the bucket: add it")
        bucket, where = _upload_target(uri, region, create_bucket)
        source = _check_dir(src)
        path = source / MANIFEST_NAME
        if not path.is_file():
            raise SparknetError(f"{src} has no {MANIFEST_NAME}: run `sparknet data shard` first")
        manifest = Manifest.loads(path.read_bytes(), str(path))
        if create_bucket:
            for line in _make_bucket(bucket, where or "us-east-1", endpoint):
                print(line, file=sys.stderr)
        total = sum(s.bytes for v in manifest.splits.values() for s in v)
        with _bytes_progress("upload") as progress:
            bar = progress.add_task("upload", total=total)
            report = upload_dataset(
                source, uri, endpoint_url=endpoint, max_concurrency=concurrency, force=force,
                on_progress=lambda n: progress.advance(bar, n),
            )  # fmt: skip
    except SparknetError as exc:
        fail(exc, debug)
    except KeyboardInterrupt:
        fail(
            SparknetError("interrupted; no manifest was uploaded, run it again to resume"),
            debug,
            130,
        )
    print(
        f"{uri}: {len(report.uploaded)} shards uploaded "
        f"({sized(report.bytes_uploaded)}), {len(report.skipped)} already there"
        + (f", {len(report.removed)} old removed" if report.removed else "")
    )
    if report.left:
        print(
            f"left alone (named like shards, but not written by sparknet): {', '.join(report.left)}"
        )
    for warning in report.warnings:
        print(warning, file=sys.stderr)


@data_app.command("verify")
def data_verify(
    uri: str = DatasetArgument,
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Check every shard's size and sha256 against the manifest; exit 1 on any difference."""
    from sparknet.data.transfer import verify_dataset  # lazy: boto3, PIL

    try:
        where, endpoint = _dataset_uri(uri, config, endpoint_url)
        _check_dataset(where)
        with _bytes_progress("verify") as progress:
            bar = progress.add_task("verify", total=None)
            report = verify_dataset(
                where, endpoint_url=endpoint, on_progress=lambda n: progress.advance(bar, n),
                on_total=lambda n: progress.update(bar, total=n),
            )  # fmt: skip
    except SparknetError as exc:
        fail(exc, debug)
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
    from sparknet.data.transfer import list_dataset  # lazy: boto3, PIL

    try:
        where, endpoint = _dataset_uri(uri, config, endpoint_url)
        _check_dataset(where)
        listing = list_dataset(where, endpoint_url=endpoint)
    except SparknetError as exc:
        fail(exc, debug)
    table = Table(title=f"{listing.uri} ({listing.num_classes} classes)")
    for col in ("split", "shards", "images", "size"):
        table.add_column(col, justify="left" if col == "split" else "right")
    for sp in listing.splits:
        table.add_row(sp.split, str(sp.shards), str(sp.samples), sized(sp.bytes))
    Console().print(table)
    if listing.missing:
        print(f"error: missing shards: {', '.join(listing.missing)}", file=sys.stderr)
        raise typer.Exit(1)
