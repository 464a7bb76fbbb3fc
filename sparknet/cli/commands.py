"""The `sparknet` command: its command groups in one typer app.

One module per command group; this one puts them in one typer app, which `sparknet.cli.main`
runs once signals are caught."""

from __future__ import annotations

import typer

from sparknet.cli import train as train_command
from sparknet.cli.ami import ami_app
from sparknet.cli.bench import bench_app
from sparknet.cli.cluster import cluster_app
from sparknet.cli.common import VersionOption, program, short_helps
from sparknet.cli.data import data_app
from sparknet.cli.evaluate import evaluate
from sparknet.cli.export import export
from sparknet.cli.predict import predict

#: what `sparknet --help` says above the commands
HELP = """\
Command line: `sparknet train` (the main job on one machine), `sparknet evaluate`,
`sparknet predict` and `sparknet export` (a run's model), `sparknet data ...` (datasets on
local disk or S3), `sparknet cluster ...` (EC2 GPU clusters), `sparknet bench ...` (the
performance figures). `sparknet-submit` runs a training job on an EC2 GPU cluster."""

app = typer.Typer(add_completion=False, no_args_is_help=True, help=HELP)


@app.callback()
def _root(version: bool = VersionOption) -> None:
    """sparknet: synchronized local SGD for PyTorch on Apache Spark."""


# the module keeps its name: a function imported as `train` would shadow the submodule
for _name, _command in (
    ("train", train_command.train),
    ("evaluate", evaluate),
    ("predict", predict),
    ("export", export),
):
    app.command(name=_name)(_command)
app.add_typer(data_app, name="data")
app.add_typer(cluster_app, name="cluster")
app.add_typer(ami_app, name="ami")
app.add_typer(bench_app, name="bench")
short_helps(app)
program("sparknet", app)
