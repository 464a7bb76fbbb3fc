"""`sparknet export`: a run's model as a file that torch alone loads (a fresh Python that never
imports sparknet), giving the outputs of the run's own weights, with model.json inside it; both
formats, for a trained run and for a torchvision ResNet's run dir."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import sparknet
from sparknet.data.store import LocalStore
from sparknet.models import build_model
from sparknet.training.saved_model import ModelInfo, ModelInput, read_info, write_info
from tests.conftest import REPO, SPARKNET

#: run in a fresh interpreter: load the file with torch alone, print its outputs and model.json
LOAD = """
import json, sys, torch
path, form = sys.argv[1], sys.argv[2]
extra = {"model.json": ""}
if form == "torchscript":
    module = torch.jit.load(path, _extra_files=extra)
else:
    module = torch.export.load(path, extra_files=extra).module()
x = torch.load(sys.argv[3])
print(json.dumps({"out": module(x).tolist(), "info": json.loads(extra["model.json"]),
                  "sparknet": "sparknet" in sys.modules}))
"""


def _loaded_alone(path, form: str, x: torch.Tensor, tmp_path) -> dict:
    torch.save(x, tmp_path / "x.pt")
    done = subprocess.run(
        [sys.executable, "-c", LOAD, str(path), form, str(tmp_path / "x.pt")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.integration
@pytest.mark.parametrize(("form", "name"), [("torchscript", "model.torchscript.pt"),
                                            ("torch-export", "model.pt2")])  # fmt: skip
def test_a_trained_runs_export_loads_with_torch_alone(digits_run, tmp_path, form, name):
    run, _ = digits_run
    out = tmp_path / name
    done = subprocess.run(
        [str(SPARKNET), "export", str(run), "--format", form, "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{out}: {form}, ")
    x = torch.randn(7, 1, 8, 8)
    got = _loaded_alone(out, form, x, tmp_path)
    assert not got["sparknet"]
    with torch.no_grad():
        want = sparknet.load_model(run)(x)
    assert torch.allclose(torch.tensor(got["out"]), want, atol=1e-6)
    assert ModelInfo.model_validate(got["info"]) == read_info(run)


@pytest.mark.parametrize("form", ["torchscript", "torch-export"])
def test_a_resnet_run_dir_exports_to_both_formats(tmp_path, form):
    run = tmp_path / "run"
    run.mkdir()
    info = ModelInfo(model="resnet18", num_classes=3,
                     input=ModelInput(kind="image", shape=(3, 32, 32), image_size=32, resize=37,
                                      mean=(0.5, 0.5, 0.5), std=(0.2, 0.2, 0.2)))  # fmt: skip
    write_info(LocalStore(run), info)
    torch.manual_seed(0)
    model = build_model("resnet18", (3, 32, 32), 3).eval()
    save_file(model.state_dict(), run / "model.safetensors")
    done = subprocess.run(
        [str(SPARKNET), "export", str(run), "--format", form],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    name = {"torchscript": "model.torchscript.pt", "torch-export": "model.pt2"}[form]
    x = torch.randn(1, 3, 32, 32)  # a batch of one, though exported with two
    got = _loaded_alone(run / name, form, x, tmp_path)
    with torch.no_grad():
        assert torch.allclose(torch.tensor(got["out"]), model(x), atol=1e-5)


@pytest.mark.integration
def test_an_export_replaces_nothing_unasked_and_names_a_file(digits_run, tmp_path):
    run, _ = digits_run
    (tmp_path / "taken.pt").write_bytes(b"mine")
    (tmp_path / "file").write_bytes(b"")
    for args, code, says in [
        (["--out", str(tmp_path / "taken.pt")], 2,
         f"error: {tmp_path}/taken.pt exists: pass --force to replace it, or another --out"),
        (["--out", f"{run}/model.safetensors", "--force"], 2,
         f"error: --out {run}/model.safetensors: model.safetensors is a run's own file; name "
         "another"),
        (["--out", "s3://bucket"], 2, "error: --out 's3://bucket': name a file (a path, or "
         "s3://bucket/key)"),
        (["--out", ""], 2, "error: --out '': name a file"),
        (["--out", str(tmp_path / "file" / "x.pt")], 2, f"error: cannot write {tmp_path}/file/"
         "x.pt: Not a directory"),
        (["--out", str(tmp_path / "taken.pt"), "--force"], 0, f"{tmp_path}/taken.pt: "),
    ]:  # fmt: skip
        done = subprocess.run([str(SPARKNET), "export", str(run), *args], capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == code, done.stderr
        assert (done.stderr or done.stdout).startswith(says)
    assert (tmp_path / "taken.pt").read_bytes() != b"mine"  # replaced, as --force asked
    assert sparknet.load_model(run) is not None  # the run's own weights untouched


def test_what_cannot_be_exported_is_one_line(tmp_path):
    for args, says in [
        (["--format", "onnx"], "error: --format onnx: use torchscript or torch-export"),
        (["--out", f"{tmp_path}/dir/"], f"error: --out '{tmp_path}/dir/': name a file (a "
         "path, or s3://bucket/key)"),
        ([], f"error: {tmp_path} has no model.json: it is not a sparknet run dir"),
    ]:  # fmt: skip
        done = subprocess.run([str(SPARKNET), "export", str(tmp_path), *args],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 2
        assert done.stderr.startswith(says) and len(done.stderr.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
