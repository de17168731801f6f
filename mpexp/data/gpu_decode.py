"""`dataset.decode=gpu`: JPEGs decoded on the GPU (nvJPEG, through torchvision's `decode_jpeg`, a
batch at a time), cropped and resized there. The DataLoader's workers only read each file's bytes
and its size from the JPEG header, and work out the crop: a worker no longer spends 2 to 3 ms of
CPU per image, and a few workers feed a GPU that decoding workers could not.

The crop is drawn as the CPU path draws it, from the image's own seed (run seed, epoch, index),
but on the full-size image: the CPU path decodes a large JPEG at a reduced scale first (Pillow's
draft mode), so the two paths' pixels differ slightly; runs compared with each other should use
the same `dataset.decode` (`ran.data.decode` records it).
"""

from __future__ import annotations

import io
import logging

import torch
from PIL import Image
from torchvision import transforms
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from mpexp.data.augment import mixed_seed
from mpexp.errors import ConfigError, DataError

log = logging.getLogger(__name__)

DECODE = ("auto", "cpu", "gpu")
JPEG = (".jpg", ".jpeg")
NO_CROP = (-1, -1, -1, -1)  # validation's box: resized and centre-cropped on the device


def check_decode(decode: str) -> None:
    if decode not in DECODE:
        raise ConfigError(f"dataset.decode={decode} is none of {', '.join(DECODE)}.")


def choose(decode: str, device: torch.device, files: list[str]) -> str:
    """Where images are decoded: `cpu` or `gpu`. `auto` is gpu on CUDA for a folder of JPEGs
    only, cpu otherwise; `gpu` without CUDA, or for a file that is no JPEG, is refused."""
    not_jpeg = next((f for f in files if not f.lower().endswith(JPEG)), None)
    if decode == "auto":
        return "gpu" if device.type == "cuda" and not_jpeg is None else "cpu"
    if decode == "gpu" and device.type != "cuda":
        raise ConfigError(
            f"dataset.decode=gpu decodes JPEGs on a CUDA GPU, and this run trains on "
            f"{device.type}. Use dataset.decode=cpu (or auto), or train on a GPU."
        )
    if decode == "gpu" and not_jpeg is not None:
        raise ConfigError(
            f"dataset.decode=gpu decodes JPEGs only, and the folder holds other images, e.g. "
            f"{not_jpeg}. Use dataset.decode=cpu, or convert them to JPEG."
        )
    return decode


def encoded(path: str) -> tuple[torch.Tensor, tuple[int, int]]:
    """The file's bytes as a uint8 tensor, and the image's (width, height) from its header (no
    pixel decoded)."""
    with open(path, "rb") as file:
        data = file.read()
    with Image.open(path) as image:
        size = image.size
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), size


def crop_box(
    size: tuple[int, int], scale: tuple[float, float], seed: int, epoch: int, index: int
) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a training image's random resized crop: what
    v2.RandomResizedCrop(scale=scale) draws for an image of `size` (width, height) from the
    image's own seed, as the CPU path seeds it."""
    width, height = size
    shape_only = torch.empty(1, 1, 1, dtype=torch.uint8).expand(3, height, width)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(mixed_seed(seed, epoch, index))
        return transforms.RandomResizedCrop.get_params(shape_only, list(scale), [3 / 4, 4 / 3])


def item(
    read: tuple[torch.Tensor, tuple[int, int]],
    crop_scale: tuple[float, float] | None,
    key: tuple[int, int | None, int],
) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """A worker's image for the GPU: its bytes and its training crop's box (NO_CROP for
    validation's view, or for training without a random resized crop)."""
    data, size = read
    index, seed, epoch = key
    if seed is None or crop_scale is None:
        return data, NO_CROP
    return data, crop_box(size, crop_scale, seed, epoch, index)


def collate(items: list[tuple]) -> tuple:
    """A batch of encoded images: ((their bytes, a list; their boxes), labels, indices,
    sources), as the image folder's batches are (images, labels, indices, sources)."""
    images, labels, index, source = zip(*items, strict=True)
    data, boxes = zip(*images, strict=True)
    as_tensor = torch.tensor
    return (list(data), as_tensor(boxes)), as_tensor(labels), as_tensor(index), as_tensor(source)


def on_device(
    batch: tuple[list[torch.Tensor], torch.Tensor],
    paths: list[str],
    device: torch.device,
    size: int,
    resize: int,
) -> torch.Tensor:
    """A batch's JPEGs as size x size uint8 images on `device`: each training image's box,
    validation's resize and centre crop."""
    data, boxes = batch
    images = decode_batch(data, device, paths)
    if bool((boxes[:, 0] < 0).all()):  # a host tensor: no device read
        return resize_centre(images, resize, size)
    return crop_resize(images, boxes, size)


def decode_batch(data: list[torch.Tensor], device: torch.device, paths: list[str]) -> list:
    """The JPEGs decoded on `device` as 3 x H x W uint8 RGB. A batch that nvJPEG refuses is
    decoded image by image, an image it cannot decode (CMYK, say) by Pillow on the host (said
    once); one that neither can decode is named by `paths` (DataError)."""
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        pass
    images = []
    for encoded_image, path in zip(data, paths, strict=True):
        try:
            images.append(decode_jpeg(encoded_image, mode=ImageReadMode.RGB, device=device))
            continue
        except RuntimeError:
            pass
        try:
            with Image.open(io.BytesIO(encoded_image.numpy().tobytes())) as image:
                pixels = v2.functional.pil_to_tensor(image.convert("RGB"))
        except Exception as err:  # Pillow raises many kinds
            raise DataError(
                f"{path} cannot be decoded ({err}). dataset.decode=gpu stops at a damaged image; "
                "replace it or remove it, or train with dataset.decode=cpu, which stands the "
                "next image in for it."
            ) from None
        images.append(pixels.to(device))
        _said_host_decoded(path)
    return images


_host_decoded: list[str] = []  # images that nvJPEG could not decode, as this process met them


def _said_host_decoded(path: str) -> None:
    _host_decoded.append(path)
    if len(_host_decoded) == 1:
        log.warning(
            "nvJPEG cannot decode %s (a CMYK or otherwise unusual JPEG, or another format under "
            "a .jpg name): it was decoded on the CPU, as any further such image will be, slowly.",
            path,
        )


def crop_resize(images: list[torch.Tensor], boxes: torch.Tensor, size: int) -> torch.Tensor:
    """Each image's box resized to size x size (antialiased bilinear, as the CPU path's random
    resized crop), stacked on the images' device."""
    return torch.stack(
        [v2.functional.resized_crop(image, *box, [size, size], antialias=True)
         for image, box in zip(images, boxes.tolist(), strict=True)]
    )  # fmt: skip


def resize_centre(images: list[torch.Tensor], resize: int, size: int) -> torch.Tensor:
    """Validation's view: shorter side resized to `resize`, then the centre size x size."""
    return torch.stack(
        [v2.functional.center_crop(v2.functional.resize(image, resize), [size, size])
         for image in images]
    )  # fmt: skip
