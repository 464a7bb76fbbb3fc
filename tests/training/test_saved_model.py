"""A run dir is a model to load: `model.json` records what the weights alone cannot say, and
`sparknet.load_model` rebuilds the module from it. A run on real local Spark; the refusals on
hand-made run dirs. (Image data, its recorded transform and class names, and a run dir on S3:
tests/data/test_imagenet_s3.py and test_run_dir_s3.py.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import sparknet
from sparknet.config import TrainConfig
from sparknet.data.sources import digits
from sparknet.data.store import LocalStore
from sparknet.errors import SparknetError
from sparknet.models import build_model
from sparknet.training.driver import train
from sparknet.training.saved_model import ModelInfo, ModelInput, read_info, write_info

pytestmark = pytest.mark.integration


def test_a_finished_run_loads_as_the_model_it_evaluated(spark, tmp_path):
    """From the run dir alone: the digits' test set through the loaded module gives the run's
    own final test accuracy (the recorded shape, class count and weights are the run's)."""
    cfg = TrainConfig(model="mlp", workers=2, tau=10, rounds=3, batch_size=32, lr=0.1,
                      out=tmp_path / "run")  # fmt: skip
    result = train(cfg, spark=spark)
    info = read_info(tmp_path / "run")
    assert info == ModelInfo(
        model="mlp", num_classes=10, input=ModelInput(kind="tensor", shape=(1, 8, 8))
    )
    model = sparknet.load_model(tmp_path / "run")
    assert not model.training
    _, test = digits()
    inputs, labels = test.tensors
    with torch.no_grad():
        correct = int((model(inputs).argmax(1) == labels).sum())
    assert correct / len(labels) == pytest.approx(result.final["eval_accuracy"], abs=1e-9)
    assert result.final["eval_accuracy"] > 0.5  # trained: chance is 0.1


def _run_dir(path, info: ModelInfo | None, weights: dict | None):
    path.mkdir()
    store = LocalStore(path)
    if info is not None:
        write_info(store, info)
    if weights is not None:
        save_file(weights, path / "model.safetensors")
    return path


def test_what_cannot_be_loaded_is_one_line_saying_why(tmp_path):
    info = ModelInfo(model="mlp", num_classes=3, input=ModelInput(kind="features", shape=(4,)))
    torch.manual_seed(0)
    fits = build_model("mlp", (4,), 3).state_dict()
    other = build_model("mlp", (5,), 3).state_dict()

    loaded = sparknet.load_model(_run_dir(tmp_path / "ok", info, fits))
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in fits.items())
    cases = [
        (_run_dir(tmp_path / "old", None, fits), r"has no model\.json: it is not a sparknet run"),
        (_run_dir(tmp_path / "running", info, None),
         r"has no model\.safetensors: its run has not finished; `sparknet train --resume --out "),
        (_run_dir(tmp_path / "other", info, other),
         r"other: its weights do not fit 'mlp' as its model\.json records it: size mismatch for "
         r"1\.weight: copying a param with shape torch\.Size\(\[128, 5\]\)"),
    ]  # fmt: skip
    for run, message in cases:
        with pytest.raises(SparknetError, match=message):
            sparknet.load_model(run)
    for text, says in [
        ('{"format": 1, "model": "mlp"}', "ok: its model.json is damaged: num_classes: Field "),
        ('{"format": 2, "model": "mlp"}', "ok: its model.json is format 2, from a newer sparknet "
         "than this one (format 1): upgrade sparknet to load it"),
        (info.model_dump_json().replace('"shape":[4]', '"shape":[0]'),
         "ok: its model.json is damaged: input.shape.0: Input should be greater than 0"),
        (info.model_dump_json()[:-1] + ', "classes": [{"index": 0, "wnid": "a"}]}',
         "ok: its model.json is damaged: the file: Value error, classes must name outputs 0..2"),
    ]:  # fmt: skip
        (tmp_path / "ok" / "model.json").write_text(text)
        with pytest.raises(SparknetError) as exc:
            sparknet.load_model(tmp_path / "ok")
        assert str(exc.value).startswith(f"{tmp_path}/{says}")
