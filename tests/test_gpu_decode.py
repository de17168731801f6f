"""dataset.decode=gpu (mpexp/data/gpu_decode.py): on the CPU, what the workers do for it (the
files' bytes, the header's size, the crop's box, the batches) and the crops' arithmetic, against
the CPU path's own transforms; its refusals; on a GPU (marked `gpu`), whole batches decoded
there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from mpexp.data import gpu_decode
from mpexp.data.augment import mixed_seed
from mpexp.data.image_folder import ImageFolderData, decode
from mpexp.errors import ConfigError
from tests.test_image_folder import write_images

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # CUDA: named, not touched, on a CPU


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("jpegs")
    write_images(root / "train", 8)
    write_images(root / "val", 2, seed=1)
    for png in root.rglob("*.png"):  # JPEGs only, as decode=gpu takes
        Image.open(png).save(png.with_suffix(".jpg"), quality=90)
        png.unlink()
    return root


def folder(path: Path, device: torch.device = CPU, **kwargs) -> ImageFolderData:
    options = {"image_size": 8, "batch_size": 4, "num_workers": 0, "mean": [0.0] * 3,
               "std": [1.0] * 3, **kwargs}  # fmt: skip
    data = ImageFolderData(path=str(path), **options)
    data.setup(device)
    return data


def test_a_box_is_the_crop_the_cpu_path_draws(jpegs):
    """The worker's box, cut and resized as the GPU does it (here on the CPU), is the image that
    v2.RandomResizedCrop gives from the same seed: the same draws, the same arithmetic."""
    data = folder(jpegs)
    split = data.splits["train"]
    for index in range(len(split)):
        image = decode(split.path(index))  # whole: the GPU decodes no reduced JPEG
        width, height = image.shape[2], image.shape[1]
        box = gpu_decode.crop_box((width, height), (0.08, 1.0), 5, 2, index)
        ours = gpu_decode.crop_resize([image], torch.tensor([box]), 8)[0]
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(mixed_seed(5, 2, index))
            theirs = v2.RandomResizedCrop((8, 8), scale=(0.08, 1.0))(image)
        assert torch.equal(ours, theirs)


def test_validations_view_is_the_cpu_paths_resize_and_centre_crop(jpegs):
    data = folder(jpegs)
    split = data.splits["val"]
    images = [decode(split.path(i)) for i in range(len(split))]
    ours = gpu_decode.resize_centre(images, 9, 8)
    theirs = torch.stack([v2.Compose([v2.Resize(9), v2.CenterCrop(8)])(x) for x in images])
    assert torch.equal(ours, theirs)


def test_workers_give_the_files_bytes_the_headers_size_and_the_box_in_batches(jpegs):
    data = folder(jpegs)
    for split in data.splits.values():
        split.on_gpu, split.crop_scale = True, (0.08, 1.0)  # as setup sets them on CUDA
    train, val = data.splits["train"], data.splits["val"]
    (encoded, box), label, index, source = train[(3, 7, 1)]
    assert bytes(encoded.numpy()) == Path(train.path(3)).read_bytes()
    assert (label, index, source) == (int(train.labels[3]), 3, 3)
    with Image.open(train.path(3)) as image:
        assert box == gpu_decode.crop_box(image.size, (0.08, 1.0), 7, 1, 3)
    assert val[(1, None, 0)][0][1] == gpu_decode.NO_CROP

    keys = [(i, 7, 1) for i in range(5)]
    loader = DataLoader(train, batch_size=5, sampler=keys, collate_fn=gpu_decode.collate)
    ((data_list, boxes), labels, indices, sources) = next(iter(loader))
    assert len(data_list) == 5 and boxes.shape == (5, 4) and boxes.dtype == torch.int64
    assert indices.tolist() == sources.tolist() == list(range(5))
    assert labels.tolist() == train.labels[:5].tolist()


def test_decode_gpu_is_refused_without_cuda_and_for_files_that_are_not_jpegs(jpegs, photos_png):
    with pytest.raises(ConfigError, match=r"dataset\.decode=gpu decodes JPEGs on a CUDA GPU"):
        folder(jpegs, decode="gpu")
    with pytest.raises(ConfigError, match=r"decodes JPEGs only, and the folder holds other"):
        gpu_decode.choose("gpu", CUDA, ["cat/1.jpg", "cat/2.png"])
    with pytest.raises(ConfigError, match=r"dataset\.decode=nvjpeg is none of auto, cpu, gpu"):
        ImageFolderData(path=".", decode="nvjpeg")
    with pytest.raises(ConfigError, match=r"choose one of the two"):
        ImageFolderData(path=".", decode="gpu", cache="resized")
    # auto: the GPU for JPEGs on CUDA, the CPU for anything else, and on a CPU
    assert gpu_decode.choose("auto", CUDA, ["a/1.JPG", "b/2.jpeg"]) == "gpu"
    assert gpu_decode.choose("auto", CUDA, ["a/1.jpg", "b/2.png"]) == "cpu"
    assert folder(jpegs, decode="auto").record()["decode"] == "cpu"
    assert folder(photos_png, decode="cpu").record()["decode"] == "cpu"


@pytest.fixture(scope="module")
def photos_png(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mixed")
    write_images(root / "train", 4)
    write_images(root / "val", 2, seed=1)
    return root


@pytest.mark.gpu
def test_jpegs_decoded_on_the_gpu_train_and_validate_like_the_cpu_path(jpegs):
    """The same images, labels and order; pixels within JPEG decoders' differences (nvJPEG's
    IDCT is not libjpeg's)."""
    gpu, cpu = folder(jpegs, CUDA, decode="gpu"), folder(jpegs, CUDA, decode="cpu")
    assert gpu.record()["decode"] == "gpu"
    for (x, y), (cx, cy) in zip(gpu.val_batches(CUDA), cpu.val_batches(CUDA), strict=True):
        assert torch.equal(y, cy) and x.shape == cx.shape and x.is_cuda
        assert (x - cx).abs().mean() < 0.05
    batches = list(gpu.train_batches(1, 0, CUDA))
    assert len(batches) == 6 and all(x.shape == (4, 3, 8, 8) for x, _ in batches)
    assert [y.tolist() for _, y in batches] == [
        y.tolist() for _, y in cpu.train_batches(1, 0, CUDA)
    ]
