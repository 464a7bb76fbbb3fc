"""`sparknet-submit`: a training job on an EC2 GPU cluster (not built yet)."""

from __future__ import annotations

import typer

from sparknet.cli.common import fail
from sparknet.errors import SparknetError

submit_app = typer.Typer(add_completion=False, help="Run a training job on an EC2 GPU cluster.")


@submit_app.command()
def submit(
    s3: str = typer.Option(
        ..., "--s3", help="dataset name from sparknet.yaml or s3://bucket/prefix"
    ),
) -> None:
    """Submit a job to a cluster (needs the cluster support, which this version does not have)."""
    fail(
        SparknetError(
            "sparknet-submit: cluster support is not in this version yet; "
            "use `sparknet train` to run locally"
        ),
        debug=False,
    )
