"""Models by name: built-in small models, torchvision architectures, or a user's factory."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
from torch import nn

from sparknet.errors import SparknetError, first_line
from sparknet.imports import is_reference, load_callable

# `# lazy: torchvision` (seconds): only its architectures need it; the built-in models and a
# user's factory never do


def mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Two hidden layers; the smallest model that learns the built-in digits well."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, num_classes),
    )


def cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Two conv+BatchNorm blocks and global pooling: small, but has the buffers a real CNN has."""
    if len(input_shape) != 3:
        raise SparknetError(
            f"model 'cnn' needs (channels, height, width) inputs, got {input_shape}"
        )
    channels = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(channels, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, num_classes),
    )


BUILTIN: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {"mlp": mlp, "cnn": cnn}


def _torchvision_names() -> list[str]:
    from torchvision import models  # lazy: torchvision

    return models.list_models(module=models)


def _from_factory(ref: str, num_classes: int) -> nn.Module:
    factory = load_callable(ref, "model")
    try:
        accepts = "num_classes" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        accepts = False
    try:
        model = factory(num_classes=num_classes) if accepts else factory()
    except Exception as exc:
        raise SparknetError(f"model factory {ref!r} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise SparknetError(
            f"model factory {ref!r} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A freshly initialised model. Call under a fixed torch seed for reproducible weights."""
    if name in BUILTIN:
        return BUILTIN[name](input_shape, num_classes)
    if is_reference(name):
        return _from_factory(name, num_classes)
    if name in _torchvision_names():
        from torchvision import models  # lazy: torchvision

        return models.get_model(name, weights=None, num_classes=num_classes)
    raise SparknetError(
        f"unknown model {name!r}: use one of {', '.join(BUILTIN)}, a torchvision model name "
        "(resnet18, alexnet, ...) or package.module:factory"
    )


def check_model_accepts(
    model: nn.Module, sample: torch.Tensor, num_classes: int, name: str
) -> None:
    """Run one sample through the model on the driver so a shape mismatch fails before Spark."""
    model.eval()
    try:
        with torch.no_grad():
            out = model(sample.unsqueeze(0))
    except Exception as exc:
        raise SparknetError(
            f"model {name!r} cannot take inputs of shape {tuple(sample.shape)}: "
            f"{type(exc).__name__}: {first_line(exc)}"
        ) from exc
    if not isinstance(out, torch.Tensor) or out.shape != (1, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise SparknetError(
            "model {name!r} must return logits of shape (batch, {classes}), got {got}; set "
            "{@num_classes} to match the dataset",
            name=name,
            classes=num_classes,
            got=got,
        )
