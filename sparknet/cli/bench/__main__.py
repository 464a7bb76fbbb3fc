"""`python -m sparknet.cli.bench NAME ...`: one benchmark as `sparknet bench NAME ...` runs it.

`sparknet bench all` starts each benchmark this way, in a fresh interpreter."""

from sparknet.cli.bench import bench_app

bench_app(prog_name="sparknet bench")
