"""`sparknet bench`: sparknet's performance figures, measured on this machine.

The paper's analysis: `sync` (seconds per synchronization round, each transport against a raw
gloo all_reduce), `scaling` (the paper's wall-time model, fed measured compute and sync costs,
checked against measured runs), `convergence` (rounds and samples to a target accuracy over K,
tau and the outer optimizer) and `peers` (sparknet against TorchDistributor and plain PyTorch on
emulated links). Each writes a JSON of every figure, a CSV of its table and a plot.

The engine's figures: `throughput`, `sync-cost`, `data-stream`, `images-per-core`,
`shard-workers`, `precision` and `startup`, each a JSON with its headline rows; `all` runs them
one process each and prints one table of those (`suite`).

All write into their output dir (`common.DEFAULT_OUT` unless given another) and assert nothing:
a goal missed is said in the report, not raised. `common` holds what they share: timing,
medians, the machine's load, results files, tables and plots.
"""
