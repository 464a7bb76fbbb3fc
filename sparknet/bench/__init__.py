"""`sparknet bench`: the figures behind the paper's analysis, measured on this machine.

`sync` (seconds per synchronization round, each transport against a raw gloo all_reduce),
`scaling` (the paper's wall-time model, fed measured compute and sync costs, checked against
measured runs) and `convergence` (rounds and samples to a target accuracy over K, tau and the
outer optimizer). Each writes a JSON of every figure, a CSV of its table and a plot into its
output dir, and asserts nothing: a goal missed is said in the report, not raised.
"""
