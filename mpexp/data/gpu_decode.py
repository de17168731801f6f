"""`dataset.decode=gpu`: JPEGs decoded on the GPU (nvJPEG, through torchvision's `decode_jpeg`, a
batch at a time), turned upright, cropped and resized there. The DataLoader's workers only read
each file's bytes, its size and EXIF orientation from its header, and draw the crop: a worker no
longer spends 2 to 3 ms of CPU per image, and a few workers feed a GPU that decoding workers could
not.

Decoding cannot race the step. nvJPEG's hardware engine does not wait for the work queued before
it on the stream it is given: its outputs may be written while earlier kernels still read the
blocks that the caching allocator handed out again (pytorch/vision#9606). So each batch is
decoded on a CUDA stream of its own (`Decoder`), which the host drains before the next decode:
nothing is then queued on that stream, and its blocks are free in fact, not only in stream order.
The step's stream is never waited on, so the host keeps its lead of many steps. The step's stream
waits on the decoding stream for the batch it reads, and `record_stream` keeps each batch's memory
from being handed out again until the step has read it.

A batch is cropped and resized as a batch (`resample`): each image's crop (validation: the whole
image) is copied into one padded tensor, a group of similar sizes at a time, and resized by two
batched matrix products with each image's own antialiased bilinear weights, the ones torchvision's
`resize(antialias=True)` (and Pillow) compute. A crop comes out within one level (of 255) of the
CPU path's `RandomResizedCrop` of the same image, and validation's resize and centre crop too.

The crop is drawn as the CPU path draws it, from the image's own seed (run seed, epoch, index),
on the upright full-size image: the CPU path decodes a large JPEG at a reduced scale first
(Pillow's draft mode), so the two paths' pixels differ slightly; runs compared with each other
should use the same `dataset.decode` (`ran.data.decode` records it).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import torch
from PIL import ExifTags, Image
from torchvision import transforms
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from mpexp.data.augment import mixed_seed
from mpexp.errors import ConfigError, DataError
from mpexp.precision.tf32 import exact_float32_matmul

log = logging.getLogger(__name__)

DECODE = ("auto", "cpu", "gpu")
JPEG = (".jpg", ".jpeg")
NO_CROP = (-1, -1, -1, -1)  # validation's box: resized and centre-cropped on the device
# EXIF orientations that turn the stored image a quarter: width and height trade places
QUARTER_TURNS = (5, 6, 7, 8)
# the most elements (3 x images x padded height x padded width) resized in one group: 64 M
# float32 elements are 256 MB, while a batch of 256 ImageNet photos holds about 140 M
GROUP_ELEMENTS = 64 * 2**20
# an ImageNet photo decoded, in values (3 x about 500 x 375): what mpexp-plan takes a photo to be
PHOTO_VALUES = 560_000


def working_bytes(batch: int, size: int) -> int:
    """An estimate of what decoding one batch holds on the device beside the step, for
    mpexp-plan: the decoded photos (uint8), one group's padded images in uint8 and float32 and
    its first product (float32), and the batch resized (uint8)."""
    decoded = batch * PHOTO_VALUES
    return decoded + min(decoded, GROUP_ELEMENTS) * (1 + 4 + 4) + batch * 3 * size * size


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


# --- in the workers ---------------------------------------------------------------------------


def encoded(path: str) -> tuple[torch.Tensor, tuple[int, int], int]:
    """The file's bytes as a uint8 tensor, the upright image's (width, height) and its EXIF
    orientation (1: stored upright), from its header: no pixel decoded."""
    with open(path, "rb") as file:
        data = file.read()
    with Image.open(path) as image:
        width, height = image.size
        orientation = image.getexif().get(ExifTags.Base.Orientation, 1)
    if orientation not in range(1, 9):  # a damaged tag: as the CPU path, left as stored
        orientation = 1
    if orientation in QUARTER_TURNS:
        width, height = height, width
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), (width, height), orientation


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
    read: tuple[torch.Tensor, tuple[int, int], int],
    crop_scale: tuple[float, float] | None,
    key: tuple[int, int | None, int],
) -> tuple[torch.Tensor, tuple[int, int, int, int], int]:
    """A worker's image for the GPU: its bytes, its training crop's box on the upright image
    (NO_CROP for validation's view, or for training without a random resized crop), and its
    EXIF orientation."""
    data, size, orientation = read
    index, seed, epoch = key
    if seed is None or crop_scale is None:
        return data, NO_CROP, orientation
    return data, crop_box(size, crop_scale, seed, epoch, index), orientation


def collate(items: list[tuple]) -> tuple:
    """A batch of encoded images: ((their bytes, a list; their boxes; their orientations),
    labels, indices, sources), as the image folder's batches are (images, labels, indices,
    sources)."""
    images, labels, index, source = zip(*items, strict=True)
    data, boxes, orientations = zip(*images, strict=True)
    as_tensor = torch.tensor
    return ((list(data), as_tensor(boxes), as_tensor(orientations)), as_tensor(labels),
            as_tensor(index), as_tensor(source))  # fmt: skip


# --- on the device ----------------------------------------------------------------------------


class Decoder:
    """Batches of JPEGs decoded, turned upright, cropped and resized on `device`, on a CUDA stream
    of their own (see the module's docstring for why)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def batch(
        self,
        encoded_batch: tuple[list[torch.Tensor], torch.Tensor, torch.Tensor],
        paths: list[str],
        size: int,
        resize: int,
        reader: torch.cuda.Stream,
    ) -> torch.Tensor:
        """A batch's JPEGs as size x size uint8 images: each training image's box, or
        validation's resize to `resize` and centre crop, for the stream `reader` (the step's,
        or one the step waits on) to read. The host is not held back by the step."""
        data, boxes, orientations = encoded_batch
        # the previous batch's decode and resize are done: nothing that nvJPEG could overtake is
        # queued on this stream, and what they freed is free. The step's stream is not waited on
        self.stream.synchronize()
        with torch.cuda.stream(self.stream):
            images = decode_batch(data, self.device, paths)
            images = [upright(x, o) for x, o in zip(images, orientations.tolist(), strict=True)]
            out = resample(images, boxes, size, resize)
        reader.wait_stream(self.stream)
        out.record_stream(reader)  # not handed out again until `reader` has read it
        return out


def decode_batch(data: list[torch.Tensor], device: torch.device, paths: list[str]) -> list:
    """The JPEGs decoded on `device` as 3 x H x W uint8 RGB, as stored (not yet upright). A batch
    that nvJPEG refuses is decoded image by image, an image it cannot decode (CMYK, say) by
    Pillow on the host (said once); one that neither can decode is named by `paths`
    (DataError)."""
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


def upright(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """A 3 x H x W image as stored, turned as its EXIF `orientation` says (as Pillow's
    `ImageOps.exif_transpose` turns it): 1 is upright already, 2 to 8 are mirrored, turned or
    both. torchvision's own `apply_exif_orientation` is newer than the oldest torchvision
    supported, and this is the same on every version."""
    if orientation == 2:
        return image.flip(-1)
    if orientation == 3:
        return image.flip(-2, -1)
    if orientation == 4:
        return image.flip(-2)
    if orientation == 5:
        return image.transpose(-2, -1)
    if orientation == 6:
        return image.transpose(-2, -1).flip(-1)
    if orientation == 7:
        return image.flip(-2, -1).transpose(-2, -1)
    if orientation == 8:
        return image.transpose(-2, -1).flip(-2)
    return image


def resample(
    images: list[torch.Tensor], boxes: torch.Tensor, size: int, resize: int
) -> torch.Tensor:
    """The images (3 x H x W uint8, on one device) as a size x size uint8 batch: each training
    image's box (top, left, height, width) resized, or, for NO_CROP, the image resized so that
    its shorter side is `resize` and its centre size x size cut (torchvision's Resize and
    CenterCrop). Antialiased bilinear, in groups of similar sizes (GROUP_ELEMENTS)."""
    count = len(images)
    device = images[0].device
    out = torch.empty(count, 3, size, size, dtype=torch.uint8, device=device)
    # each axis as (the source's length, the virtual output's, the first output row's place)
    rows, cols = [], []
    regions = []  # what of each image is resized: (top, left, height, width)
    for image, box in zip(images, boxes.tolist(), strict=True):
        height, width = image.shape[1:]
        if box[0] < 0:  # validation: the whole image, to a virtual resized one, its centre cut
            new_h, new_w = resized_shape(height, width, resize)
            top, left = centre_offsets(new_h, new_w, size)
            rows.append((height, new_h, top))
            cols.append((width, new_w, left))
            regions.append((0, 0, height, width))
        else:
            rows.append((box[2], size, 0))
            cols.append((box[3], size, 0))
            regions.append(tuple(box))
    for group in _groups(rows, cols):
        height = max(rows[i][0] for i in group)
        width = max(cols[i][0] for i in group)
        padded = torch.zeros(len(group), 3, height, width, dtype=torch.uint8, device=device)
        for slot, i in enumerate(group):  # a copy of each crop: no kernel series per image
            top, left, h, w = regions[i]
            padded[slot, :, :h, :w] = images[i][:, top : top + h, left : left + w]
        axes = torch.tensor([[rows[i] for i in group], [cols[i] for i in group]])
        weights_h = bilinear_weights(axes[0].to(device), size, height)  # (group, size, height)
        weights_w = bilinear_weights(axes[1].to(device), size, width)
        with exact_float32_matmul():  # TF32's 10-bit mantissa would move pixels a level
            pixels = weights_h.unsqueeze(1) @ padded.float() @ weights_w.unsqueeze(1).mT
        index = torch.tensor(group).to(device)
        out.index_copy_(0, index, pixels.round_().clamp_(0, 255).to(torch.uint8))
    return out


def resized_shape(height: int, width: int, resize: int) -> tuple[int, int]:
    """The shape torchvision's Resize(resize) gives: the shorter side `resize`, the longer in
    proportion, rounded down."""
    if height <= width:
        return resize, int(resize * width / height)
    return int(resize * height / width), resize


def centre_offsets(height: int, width: int, size: int) -> tuple[int, int]:
    """Where torchvision's CenterCrop(size) starts in a height x width image (negative: padded
    by that much first)."""

    def start(length: int) -> int:
        if length < size:
            return -((size - length) // 2)
        return round((length - size) / 2.0)

    return start(height), start(width)


def bilinear_weights(axis: torch.Tensor, size: int, padded: int) -> torch.Tensor:
    """(images, size, padded) float32 weights of antialiased bilinear resampling along one axis:
    row i of image g takes source pixel p with the weight Pillow and torchvision give it for
    resizing a source of `axis[g, 0]` pixels to `axis[g, 1]`, output pixel i + axis[g, 2]
    (one outside the virtual output is zero, as a centre crop's padding is)."""
    device = axis.device
    length, virtual, offset = (axis[:, k].float() for k in range(3))
    scale = length / virtual
    support = scale.clamp(min=1.0)  # a triangle that widens as the image shrinks: antialiased
    place = torch.arange(size, device=device, dtype=torch.float32) + offset[:, None]
    centre = (place + 0.5) * scale[:, None]
    source = torch.arange(padded, device=device, dtype=torch.float32)
    distance = (source[None, None, :] + 0.5 - centre[:, :, None]) / support[:, None, None]
    weights = (1 - distance.abs_()).clamp_(min=0)
    weights *= source[None, None, :] < length[:, None, None]
    weights *= ((place >= 0) & (place < virtual[:, None]))[:, :, None]
    return weights / weights.sum(-1, keepdim=True).clamp_(min=1e-12)


def _groups(rows: list[tuple], cols: list[tuple]) -> Iterator[list[int]]:
    """The images' indices in groups of similar sizes, each at most GROUP_ELEMENTS once padded
    to its largest height and width (an image larger than that alone)."""
    order = sorted(range(len(rows)), key=lambda i: (rows[i][0], cols[i][0]))
    group: list[int] = []
    height = width = 0
    for i in order:
        h, w = max(height, rows[i][0]), max(width, cols[i][0])
        if group and 3 * (len(group) + 1) * h * w > GROUP_ELEMENTS:
            yield group
            group, h, w = [], rows[i][0], cols[i][0]
        group.append(i)
        height, width = h, w
    if group:
        yield group
