"""`sparknet bench ...`: sparknet's performance figures, measured on this machine.

Its help (`HELP`) says which there are and what each writes.
"""

from __future__ import annotations

import typer

from sparknet.cli.bench import engine, paper

#: what `sparknet bench --help` says above the benchmarks
HELP = """\
`sparknet bench ...`: sparknet's performance figures, measured on this machine. The paper's
analysis (sync, scaling, convergence, peers: a table, a JSON, a CSV and a plot each) and the
engine's own figures against the references they stand in for (throughput, sync-cost,
data-stream, images-per-core, shard-workers, precision, startup: a JSON each; `all` runs those
one process each, then one table of their headlines). Every one writes into `--out` (default
`bench/`) and asserts nothing: a goal missed is a line in the report."""

bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help=HELP)

for _name, _command in (
    ("sync", paper.sync),
    ("scaling", paper.scaling),
    ("convergence", paper.convergence),
    ("peers", paper.peers),
    ("throughput", engine.throughput),
    ("sync-cost", engine.sync_cost),
    ("data-stream", engine.data_stream),
    ("images-per-core", engine.images_per_core),
    ("shard-workers", engine.shard_workers),
    ("precision", engine.precision),
    ("startup", engine.startup),
    ("all", engine.all_),
):
    bench_app.command(_name)(_command)
