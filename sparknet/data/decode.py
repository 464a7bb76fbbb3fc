"""Image bytes to what shard writing and training use.

The decode check, `--max-side`'s shrink, and ImageNet's decoders and transforms for training
and evaluation.

Kept apart from `imagenet` (finding a dataset's images and labels): these run per image, in the
shard writer's processes and in the tasks' DataLoader workers, and torchvision is imported only
where a tensor is made, so shard writing never needs torch.
"""

from __future__ import annotations

import io
import re
import warnings
from typing import TYPE_CHECKING, NamedTuple

from PIL import Image

if TYPE_CHECKING:
    import torch
    from torchvision.transforms.v2 import Compose

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: the eval resize keeps ImageNet's standard 224/256 crop ratio at any image size
EVAL_CROP_RATIO = 224 / 256


class ImageCheck(NamedTuple):
    """What the decode check found: why the image cannot be used (None when it can), and its
    size in pixels (0 x 0 when it does not decode)."""

    problem: str | None
    width: int = 0
    height: int = 0


def inspect_image(data: bytes) -> ImageCheck:
    """Whether `data` is an image training can decode (the reason in one line when not), and its
    size.

    `verify` checks the file's structure and `load` decodes every pixel, which is what finds a
    truncated or garbled JPEG; `data shard` calls this on every image so that a bad file is named
    once, at shard time, instead of being skipped silently on every epoch.
    """
    if not data:
        return ImageCheck("empty file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. corrupt EXIF: a warning, the pixels are fine
            with Image.open(io.BytesIO(data)) as image:
                image.verify()
            with Image.open(io.BytesIO(data)) as image:
                image.load()
                width, height = image.size
    except Exception as exc:  # PIL raises many types for bad data (OSError, SyntaxError, ...)
        return ImageCheck(_without_addresses(" ".join(str(exc).split())) or type(exc).__name__)
    return ImageCheck(None, width, height)


def shrink(data: bytes, max_side: int, quality: int) -> bytes:
    """`data` re-encoded as an RGB JPEG whose longer side is `max_side`, when it is longer;
    otherwise `data` as it is (no second lossy encoding for nothing).

    `thumbnail` decodes at libjpeg's reduced DCT scale first (`draft`) and then resamples with
    antialiasing from at least twice the target, so a 500x375 photo costs a fraction of a full
    decode. EXIF orientation is not applied, as torchvision's loader does not apply it.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Image.open(io.BytesIO(data)) as image:
            if max(image.size) <= max_side:
                return data
            image.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
            rgb = image if image.mode == "RGB" else image.convert("RGB")
            out = io.BytesIO()
            rgb.save(out, format="JPEG", quality=quality)
    return out.getvalue()


def _without_addresses(reason: str) -> str:
    """PIL names the stream it read (`<_io.BytesIO object at 0x7f...>`): an address that differs
    every run and tells the user nothing."""
    return re.sub(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>", "", reason).strip()


def decode_image(data: bytes, min_size: int | None = None) -> Image.Image:
    """Decode encoded image bytes to an RGB PIL image; raises on corrupt data.

    With `min_size`, a JPEG is decoded at the smallest of libjpeg's 1/2, 1/4, 1/8 scales whose
    shorter side is still >= min_size (PIL's draft mode): training at 32-64 px on CPU then skips
    most of the IDCT work, several times faster than decoding a 500x375 photo in full.
    """
    image = Image.open(io.BytesIO(data))
    if min_size is not None:
        # draft picks the largest scale with both sides >= the requested ones; a no-op if not JPEG
        image.draft("RGB", (min_size, min_size))
    image.load()
    return image if image.mode == "RGB" else image.convert("RGB")


class TrainDecoder:
    """Encoded bytes to a uint8 CHW tensor with ImageNet's training augmentation (random-resized
    crop to `size`, horizontal flip), decoding a JPEG only as finely as the crop needs.

    The crop is drawn from the image's header first (PIL opens lazily; the same rule and random
    draws as torchvision's RandomResizedCrop), then the JPEG is decoded at the smallest of
    libjpeg's 1/2, 1/4, 1/8 DCT scales at which the crop still has at least `size` pixels a
    side: a large crop of a large photo costs a fraction of a full decode, and no crop is ever
    upsampled more than after a full decode. The crop is resized by torch's vectorised uint8
    bilinear kernel (antialiased, as torchvision's transform is).

    Scaling to float and normalizing happen once per batch (`normalize`), not per image: one
    vectorised op instead of a few per image, and a quarter of the bytes through the DataLoader's
    worker queues. All randomness is drawn from torch's global CPU generator, so seeding it
    before each sample makes its augmentation reproducible (a retried task sees the same crops).
    """

    SCALE = (0.08, 1.0)
    RATIO = (3 / 4, 4 / 3)

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, data: bytes) -> torch.Tensor:
        import torch  # lazy: torch
        from torchvision.transforms import RandomResizedCrop  # lazy: torchvision
        from torchvision.transforms.v2 import functional as F  # lazy: torchvision

        image = Image.open(io.BytesIO(data))
        width, height = image.size
        top, left, h, w = RandomResizedCrop.get_params(image, self.SCALE, self.RATIO)
        reduce = 1
        while reduce < 8 and min(h, w) >= 2 * reduce * self.size:
            reduce *= 2
        if reduce > 1:  # draft picks the largest scale with both sides >= the requested ones
            image.draft("RGB", (-(-width // reduce), -(-height // reduce)))
        sx, sy = width / image.size[0], height / image.size[1]
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        pixels = F.pil_to_tensor(rgb)
        y0, x0 = round(top / sy), round(left / sx)
        crop = pixels[
            :, y0 : max(y0 + 1, round((top + h) / sy)), x0 : max(x0 + 1, round((left + w) / sx))
        ]
        # torch's uint8 bilinear kernel (antialiased, vectorised): 1.5-2.5x PIL's resize here
        out = F.resize(crop, [self.size, self.size], antialias=True)
        if torch.rand(1) < 0.5:  # RandomHorizontalFlip's draw
            out = out.flip(-1)
        return out


class EvalDecoder:
    """Encoded bytes to a uint8 CHW tensor for evaluation: decoded at the smallest JPEG scale
    that still covers the eval resize, then `eval_transform`."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.transform = eval_transform(size)

    def __call__(self, data: bytes) -> torch.Tensor:
        return self.transform(decode_image(data, eval_resize(self.size)))


def eval_resize(image_size: int) -> int:
    """The shorter side an eval image is resized to before the centre crop (256 for 224)."""
    return round(image_size / EVAL_CROP_RATIO)


def eval_transform(image_size: int) -> Compose:
    """ImageNet evaluation: resize the shorter side to size*256/224, centre crop; uint8 CHW."""
    from torchvision.transforms import v2  # lazy: torchvision

    return v2.Compose(
        [
            v2.Resize(eval_resize(image_size), antialias=True),
            v2.CenterCrop(image_size),
            v2.ToImage(),
        ]
    )


def normalize(
    batch: torch.Tensor,
    mean: tuple[float, float, float] = IMAGENET_MEAN,
    std: tuple[float, float, float] = IMAGENET_STD,
) -> torch.Tensor:
    """A uint8 (N, 3, H, W) batch to float32 scaled to [0, 1] and normalized with `mean` and
    `std` (ImageNet's), as `ToDtype(scale=True)` + `Normalize` would do image by image."""
    import torch  # lazy: torch

    m = torch.tensor(mean).view(1, 3, 1, 1)
    s = torch.tensor(std).view(1, 3, 1, 1)
    return batch.to(torch.float32).div_(255).sub_(m).div_(s)
