"""`sparknet-submit --dry-run`: every check a launch runs first, then the plan, and nothing made.

sparknet-submit runs in process (typer's runner) against moto's EC2 and S3, with `up` and
`down` replaced by recorders that prove neither was reached (nothing real can launch here)."""

from __future__ import annotations

import boto3

from tests.jobs.test_submitter import _dataset, _submit, _tagged
from tests.moto_server import amazon_ami


def _settings(tmp_path, bucket: str) -> None:
    (tmp_path / "sparknet.yaml").write_text(
        f"clusters:\n  c1: {{bucket: {bucket}, data_prefix: ds/, ami: {amazon_ami()}}}\n"
    )


def test_a_dry_run_checks_prints_the_plan_and_makes_nothing(
    home,
    launches,
    bucket,
    tmp_path,
) -> None:
    """Machines, their price per hour from the bundled on-demand table (a g5.xlarge master
    $1.006 and two g4dn.xlarge workers $0.526 each, 100 GiB gp3 and a public IPv4 address
    each), the data's splits, the run prefix, the settings as the driver would run them (one
    Spark task per GPU of the three nodes); exit 0, nothing on EC2, nothing under the runs
    prefix, no job recorded."""
    uri = _dataset(bucket)
    _settings(tmp_path, bucket)
    done = _submit(
        "--s3", uri, "--dry-run", "--workers", "2", "--instance-type", "g4dn.xlarge",
        "--instance-type", "g5.xlarge", "--on-demand", "--rounds", "7",
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    out = done.stdout.splitlines()
    head = "dry run: every check passed; nothing was launched. train on cluster c1 (to make):"
    assert out[0] == head
    ebs = 0.08 * 100 / 730
    master, workers = 1.006 + ebs + 0.005, 2 * (0.526 + ebs + 0.005)
    assert out[1].startswith(f"  master: 1 x g5.xlarge (on-demand), ${master:.2f}/hour")
    assert out[2].startswith(
        f"  workers: 2 x g4dn.xlarge (on-demand; fallback g5.xlarge), ${workers:.2f}/hour"
    )
    assert out[3].startswith(f"  per hour in all: ${master + workers:.2f}/hour"), out[3]
    sizes = "train 6 samples in 3 shards (9 B); val 2 samples in 1 shard (3 B)"
    assert f"dataset: {uri}: {sizes}" in out
    assert f"run prefix: s3://{bucket}/runs/c1/RUN/ (RUN: the run id a launch gets)" in out
    settings = out[out.index("settings:") + 1 :]
    assert {"  rounds: 7", "  workers: 3", "  model: cnn", "  gpus_per_worker: 1"} <= set(settings)
    assert not any(line.startswith("  master:") for line in settings)
    assert launches == [] and _tagged("c1") == []
    assert boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix="runs/")["KeyCount"] == 0
    assert not (home / "jobs").exists() and not (tmp_path / "runs").exists()


def test_a_dry_run_refuses_what_a_launch_refuses(home, launches, bucket, tmp_path) -> None:
    """A check that fails fails the dry run as it fails a launch: one line, exit 2."""
    uri = _dataset(bucket)
    _settings(tmp_path, bucket)
    for args, line in (
        (("--model", "resnet9000"), "error: unknown model 'resnet9000'"),
        (("--workers", "3"), "error: the dataset has 3 train shards, fewer than its 4 Spark"),
        (("--cluster", "c1"), "error: --cluster c1: "),
    ):
        done = _submit("--s3", uri, "--dry-run", *args)
        assert done.exit_code == 2 and len(done.stderr.splitlines()) == 1, done.output
        assert done.stderr.startswith(line), done.stderr
        assert done.stdout == ""
    assert launches == [] and _tagged("c1") == []


def test_a_model_jobs_plan_lists_its_own_options_not_the_runs_training() -> None:
    """evaluate and predict are run with the run's model, the split, the Spark tasks and
    predict's own options; the run's rounds and lr play no part, and are not listed."""
    from sparknet.config import TrainConfig
    from sparknet.jobs.model_jobs import ModelTask
    from sparknet.jobs.plan import task_settings

    cfg = TrainConfig(model="mlp", rounds=40, lr=0.3, batch_size=4, workers=3)
    shown = task_settings(ModelTask("predict", "s3://b/runs/c/R1", batch_size=128), cfg)
    assert shown == {
        "run": "s3://b/runs/c/R1", "model": "mlp", "split": "val", "workers": 3,
        "device": "auto", "top_k": None, "batch_size": 128,
    }  # fmt: skip
    evaluate = task_settings(ModelTask("evaluate", "runs/x", split="train"), cfg)
    assert evaluate["split"] == "train" and "top_k" not in evaluate and "rounds" not in evaluate


def test_a_region_without_the_default_types_plans_those_it_has(
    home, launches, tmp_path, moto_endpoint
) -> None:
    """In us-west-1, whose offerings (moto's copy of AWS's) have neither g5 nor g6, a cluster
    left at the default types plans g4dn.xlarge for the master and the workers, instead of
    refusing the whole cluster for a fallback type it would never need."""
    import uuid

    bucket = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(
        Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-1"}
    )
    uri = _dataset(bucket)
    (tmp_path / "sparknet.yaml").write_text(
        f"clusters:\n  c1: {{region: us-west-1, bucket: {bucket}, data_prefix: ds/, "
        f"ami: {amazon_ami('us-west-1')}}}\n"
    )
    done = _submit("--s3", uri, "--dry-run", "--workers", "2")
    assert done.exit_code == 0, done.output
    out = done.stdout.splitlines()
    assert out[1].startswith("  master: 1 x g4dn.xlarge (on-demand)"), out
    assert out[2].startswith("  workers: 2 x g4dn.xlarge (on-demand)"), out
    assert "fallback" not in out[2], out
    # the plan says why: the line `up` will say
    notes = [line for line in out if line.startswith("note: us-west-1 (AZs ")]
    assert len(notes) == 1 and notes[0].endswith(
        "offers no g5.xlarge, g6.xlarge: of the default types, master g4dn.xlarge and workers "
        "g4dn.xlarge"
    ), out
    assert launches == []
