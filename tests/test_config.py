from pathlib import Path

import pytest

from sparknet.config import TrainConfig, load_datasets, load_train_config
from sparknet.errors import SparknetError


def test_sources_override_in_order(tmp_path: Path):
    cfg_file = tmp_path / "sparknet.yaml"
    cfg_file.write_text("train:\n  tau: 7\n  lr: 0.2\n  rounds: 3\n  seed: 5\n")
    cfg = load_train_config(
        config_file=cfg_file,
        environ={"SPARKNET_TRAIN_LR": "0.3", "SPARKNET_TRAIN_ROUNDS": "4"},
        sets=["rounds=9", "master=local[4]"],
        flags={"seed": 11, "tau": None},
    )
    assert (cfg.tau, cfg.lr, cfg.rounds, cfg.seed, cfg.master) == (7, 0.3, 9, 11, "local[4]")


def test_a_set_value_with_colons_stays_text_not_a_base_60_number():
    """YAML 1.1 reads `5:1` as 301; `--set fail_once=5:1` and its variable mean the text."""
    cfg = load_train_config(
        config_file=None,
        environ={"SPARKNET_TRAIN_FAIL_ONCE": "2:0"},
        sets=["fail_once=5:1", "lr=0.5"],
        flags={},
    )
    assert cfg.fail_once == "5:1" and cfg.lr == 0.5
    env_only = load_train_config(
        config_file=None, environ={"SPARKNET_TRAIN_FAIL_ONCE": "2:0"}, sets=[], flags={}
    )
    assert env_only.fail_once == "2:0"


def test_nesterov_gets_diloco_defaults_and_average_is_plain_mean():
    assert (
        TrainConfig(outer="nesterov").outer_lr,
        TrainConfig(outer="nesterov").outer_momentum,
    ) == (0.7, 0.9)
    avg = TrainConfig()
    assert (avg.outer_lr, avg.outer_momentum) == (1.0, 0.0)


def test_saved_config_round_trips(tmp_path: Path):
    cfg = TrainConfig(outer="nesterov", outer_lr=0.5, out=tmp_path)
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    assert load_train_config(config_file=path, environ={}) == cfg


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"sets": ["tau=0"]},
            "invalid setting tau: a whole number of steps (at least 1) or auto (got 0)",
        ),
        ({"sets": ["outer_lr=0.5"]}, "outer 'average' has no lr or momentum"),
        ({"sets": ["optimizer=lbfgs"]}, "invalid setting optimizer"),
        ({"sets": ["taus=3"]}, "unknown setting 'taus'"),
        ({"sets": ["tau"]}, "--set expects key=value"),
        ({"sets": ["tau_max=yes"]}, "invalid setting tau_max: a whole number of steps, not true"),
        ({"sets": ["tau_max=0"]}, "invalid setting tau_max"),
        ({"config_file": Path("/nonexistent/sparknet.yaml")}, "cannot read config file"),
    ],
)
def test_bad_settings_give_one_line(kwargs, message):
    with pytest.raises(SparknetError) as exc:
        load_train_config(environ={}, **kwargs)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_a_misspelt_section_names_the_known_ones(tmp_path: Path):
    cfg_file = tmp_path / "sparknet.yaml"
    cfg_file.write_text("trian:\n  rounds: 3\n")
    with pytest.raises(SparknetError) as exc:
        load_train_config(config_file=cfg_file, environ={})
    assert str(exc.value) == (
        f"config file {cfg_file}: unknown section 'trian:'; the sections are "
        "train:, datasets:, clusters:, spark:"
    )
    with pytest.raises(SparknetError, match="unknown section 'trian:'"):
        load_datasets(cfg_file)


def test_the_fault_drill_is_not_written_to_config_yaml():
    assert "fail_once" not in TrainConfig(fail_once="1:0").to_yaml()


def test_trajectory_changes_name_only_what_alters_the_weights():
    before = TrainConfig(workers=2, rounds=5)
    after = TrainConfig(workers=3, rounds=9, lr=0.1, eval_every=1, master="local[2]")
    assert after.trajectory_changes(before) == {"workers": (2, 3), "lr": (0.05, 0.1)}
    assert TrainConfig(rounds=50).trajectory_changes(before) == {}


def test_a_config_that_is_not_utf8_is_one_line(tmp_path: Path):
    path = tmp_path / "sparknet.yaml"
    path.write_bytes(b"train:\n  lr: 0.1 # \xe9t\xe9\n")  # Latin-1
    with pytest.raises(SparknetError, match=r"is not UTF-8 text \(byte 19\); save it as UTF-8$"):
        load_train_config(config_file=path, environ={})


def test_spark_settings_merge_file_then_conf_flags(tmp_path: Path):
    cfg_file = tmp_path / "sparknet.yaml"
    cfg_file.write_text(
        "spark:\n  spark.executor.memory: 8g\n  spark.task.cpus: 2\n  spark.x.on: true\n"
    )
    cfg = load_train_config(
        config_file=cfg_file, conf=["spark.task.cpus=4", "spark.y=a=b"], environ={}
    )
    assert cfg.spark_conf == {
        "spark.executor.memory": "8g",
        "spark.task.cpus": "4",
        "spark.x.on": "true",
        "spark.y": "a=b",
    }
    resumed = load_train_config(base=cfg.model_dump(mode="json"), conf=["spark.z=1"], environ={})
    assert resumed.spark_conf["spark.executor.memory"] == "8g"
    assert resumed.spark_conf["spark.z"] == "1"


def test_a_conf_without_equals_is_one_line():
    with pytest.raises(SparknetError, match="--conf expects a Spark setting key=value"):
        load_train_config(conf=["spark.task.cpus"], environ={})


def test_an_empty_spark_section_is_none_and_a_nested_value_is_refused(tmp_path: Path):
    cfg_file = tmp_path / "sparknet.yaml"
    cfg_file.write_text("train:\n  rounds: 3\nspark:\n")
    assert load_train_config(config_file=cfg_file, environ={}).spark_conf == {}
    cfg_file.write_text("spark:\n  spark.jars.packages:\n    - a:b:1\n")
    with pytest.raises(SparknetError) as exc:
        load_train_config(config_file=cfg_file, environ={})
    assert str(exc.value) == (
        f"config file {cfg_file}: spark setting 'spark.jars.packages' is a list; give it one "
        "value (text, a number, true/false), as Spark takes it"
    )


def test_the_choosers_settings_change_nothing_between_two_fixed_taus():
    """With a fixed tau on both sides of a resume tau_share and tau_max choose nothing: not a
    change to refuse; once either side is auto they are."""
    fixed = TrainConfig(tau=5)
    assert TrainConfig(tau=5, tau_max=7, tau_share=0.3).trajectory_changes(fixed) == {}
    assert TrainConfig(tau="auto", tau_max=7).trajectory_changes(fixed) == {
        "tau": (5, "auto"),
        "tau_max": (100, 7),
    }
    auto = TrainConfig(tau="auto")
    assert TrainConfig(tau="auto", tau_max=7).trajectory_changes(auto) == {"tau_max": (100, 7)}
