#!/bin/sh
# written by sparknet bootstrap: the GPUs Spark's worker offers, from nvidia-smi
set -e
ids=$(nvidia-smi --query-gpu=index --format=csv,noheader)
printf '{"name": "gpu", "addresses": ['
sep=
for id in $ids; do
  printf '%s"%s"' "$sep" "$id"
  sep=', '
done
printf ']}\n'
