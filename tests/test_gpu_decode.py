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
from mpexp.data.image_folder import ImageFolderData
from mpexp.data.image_folder.reading import decode
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


def within_a_level(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """uint8 images equal but for rounding: float weights here, torchvision's fixed point."""
    return ours.shape == theirs.shape and int((ours.int() - theirs.int()).abs().max()) <= 1


def test_a_box_is_the_crop_the_cpu_path_draws(jpegs):
    """The worker's box, cut and resized as the GPU does it (here on the CPU), is the image that
    v2.RandomResizedCrop gives from the same seed: the same draws, the same filter."""
    data = folder(jpegs)
    split = data.splits["train"]
    images = [decode(split.path(i)) for i in range(len(split))]  # whole: as nvJPEG decodes
    boxes = [gpu_decode.crop_box((x.shape[2], x.shape[1]), (0.08, 1.0), 5, 2, i)
             for i, x in enumerate(images)]  # fmt: skip
    ours = gpu_decode.resample(images, torch.tensor(boxes), 8, 9)
    for index, image in enumerate(images):
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(mixed_seed(5, 2, index))
            theirs = v2.RandomResizedCrop((8, 8), scale=(0.08, 1.0))(image)
        assert within_a_level(ours[index], theirs)


def test_validations_view_is_the_cpu_paths_resize_and_centre_crop(jpegs):
    data = folder(jpegs)
    split = data.splits["val"]
    images = [decode(split.path(i)) for i in range(len(split))]
    ours = gpu_decode.resample(images, torch.tensor([gpu_decode.NO_CROP] * len(images)), 8, 9)
    theirs = torch.stack([v2.Compose([v2.Resize(9), v2.CenterCrop(8)])(x) for x in images])
    assert within_a_level(ours, theirs)


@pytest.mark.parametrize("size", [8, 64, 224])
def test_a_batch_of_assorted_sizes_is_resized_as_torchvision_resizes_each(size, monkeypatch):
    """Shrunk and enlarged, tall and wide, crops and validation's view, in several groups:
    each image within a level of torchvision's own resize of it alone."""
    monkeypatch.setattr(gpu_decode, "GROUP_ELEMENTS", 3 * 4 * 300 * 300)  # groups of a few
    generator = torch.Generator().manual_seed(0)
    shapes = [(14, 40), (40, 14), (300, 200), (9, 9), (77, 500), (224, 224), (600, 450)] * 2
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=generator)
              for h, w in shapes]  # fmt: skip
    boxes = [v2.RandomResizedCrop.get_params(x, [0.08, 1.0], [3 / 4, 4 / 3]) for x in images[:7]]
    boxes += [gpu_decode.NO_CROP] * 7
    resize = size * 8 // 7
    ours = gpu_decode.resample(images, torch.tensor(boxes), size, resize)
    for image, box, got in zip(images, boxes, ours, strict=True):
        if box == gpu_decode.NO_CROP:
            theirs = v2.functional.center_crop(v2.functional.resize(image, resize), [size, size])
        else:
            theirs = v2.functional.resized_crop(image, *box, [size, size], antialias=True)
        assert within_a_level(got, theirs)


def test_a_batch_is_resized_by_the_same_few_operations_whatever_its_size(monkeypatch):
    """One copy per image into the padded group, then the same batched products: no resize
    (a kernel series) per image."""
    called: list[str] = []

    class Counting(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            called.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    def heavy(count: int) -> list[str]:
        images = [torch.zeros(3, 30 + i, 40, dtype=torch.uint8) for i in range(count)]
        boxes = torch.tensor([(1, 2, 20, 25)] * count)
        called.clear()
        with Counting():
            gpu_decode.resample(images, boxes, 16, 18)
        return sorted(f for f in called if f in ("matmul", "interpolate", "__matmul__", "resize"))

    assert heavy(4) == heavy(32) and heavy(4)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_a_photo_is_turned_upright_by_its_exif_orientation_as_pillow_turns_it(
    tmp_path, orientation
):
    """What the workers read from the header (the upright size) and what the device does to
    the decoded pixels: the CPU path's upright image, for each of the eight orientations."""
    generator = torch.Generator().manual_seed(orientation)
    pixels = torch.randint(0, 256, (3, 5, 7), dtype=torch.uint8, generator=generator)
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / "photo.png"  # lossless: the pixels themselves compared
    v2.functional.to_pil_image(pixels).save(path, exif=exif)
    _, (width, height), read = gpu_decode.encoded(str(path))
    expected = decode(str(path))  # the CPU path's: Pillow's exif_transpose
    assert read == orientation and (height, width) == tuple(expected.shape[1:])
    assert torch.equal(gpu_decode.upright(pixels, orientation), expected)


def test_workers_give_the_files_bytes_the_headers_size_and_the_box_in_batches(jpegs):
    data = folder(jpegs)
    for split in data.splits.values():
        split.on_gpu, split.crop_scale = True, (0.08, 1.0)  # as setup sets them on CUDA
    train, val = data.splits["train"], data.splits["val"]
    (encoded, box, orientation), label, index, source = train[(3, 7, 1)]
    assert bytes(encoded.numpy()) == Path(train.path(3)).read_bytes() and orientation == 1
    assert (label, index, source) == (int(train.labels[3]), 3, 3)
    with Image.open(train.path(3)) as image:
        assert box == gpu_decode.crop_box(image.size, (0.08, 1.0), 7, 1, 3)
    assert val[(1, None, 0)][0][1] == gpu_decode.NO_CROP

    keys = [(i, 7, 1) for i in range(5)]
    loader = DataLoader(train, batch_size=5, sampler=keys, collate_fn=gpu_decode.collate)
    ((data_list, boxes, orientations), labels, indices, sources) = next(iter(loader))
    assert len(data_list) == 5 and boxes.shape == (5, 4) and boxes.dtype == torch.int64
    assert orientations.tolist() == [1] * 5
    assert indices.tolist() == sources.tolist() == list(range(5))
    assert labels.tolist() == train.labels[:5].tolist()


def test_a_turned_photos_crop_is_drawn_on_its_upright_size(tmp_path):
    """A camera's 40x20 sensor image with orientation 6 is 20 wide and 40 high upright: the box
    is the one the CPU path draws on the upright image (before, on the sensor's shape)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "turned.jpg"
    Image.new("RGB", (40, 20), (200, 10, 10)).save(path, exif=exif)
    read = gpu_decode.encoded(str(path))
    assert read[1] == (20, 40)
    _, box, _ = gpu_decode.item(read, (0.08, 1.0), (0, 3, 1))
    assert box == gpu_decode.crop_box((20, 40), (0.08, 1.0), 3, 1, 0)
    top, left, height, width = box
    assert top + height <= 40 and left + width <= 20


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


def captured_step(batch_size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
    """A small classifier's whole training step (forward, backward, SGD) captured as one CUDA
    graph, replayed on what is copied into its static inputs, as the run's captured step is."""
    model = torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(3 * 8 * 8, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 3),
    ).to(CUDA)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    images = torch.zeros(batch_size, 3, 8, 8, device=CUDA)
    labels = torch.zeros(batch_size, dtype=torch.int64, device=CUDA)

    def step() -> None:
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()

    warmup = torch.cuda.Stream()
    warmup.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(warmup)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        step()
    return graph, images, labels


@pytest.mark.gpu
def test_batches_decoded_on_the_gpu_while_the_captured_step_runs_ahead_are_the_cpu_decodes(jpegs):
    """A captured step trains on each GPU-decoded batch while the GPU is kept busy, so that the
    host runs many steps ahead of it (where nvJPEG, on the step's stream, wrote into blocks that
    queued kernels still read: pytorch/vision#9606). Step after step, epoch after epoch, every
    batch is the CPU decode of the same files, within the decoders' difference (nvJPEG's IDCT
    and chroma upsampling are not libjpeg's), with the same labels; validation's too."""
    gpu, cpu = folder(jpegs, CUDA, decode="gpu"), folder(jpegs, CUDA, decode="cpu")
    assert gpu.record()["decode"] == "gpu"
    epochs = range(1, 4)
    expected = {e: [(x.clone(), y.clone()) for x, y in cpu.train_batches(e, 0, CUDA)]
                for e in epochs}  # fmt: skip
    expected_val = [(x.clone(), y.clone()) for x, y in cpu.val_batches(CUDA)]
    graph, images, labels = captured_step(4)
    compared = []  # on the device, read once at the end: the host is never held back
    for e in epochs:
        batches = list(zip(gpu.train_batches(e, 0, CUDA), expected[e], strict=True))
        assert len(batches) == 6
        for (x, y), (cx, cy) in batches:
            images.copy_(x)
            labels.copy_(y)
            graph.replay()
            torch.cuda._sleep(20_000_000)  # about 10 ms of GPU time a step: the host runs ahead
            compared.append(((x - cx).abs().mean(), (y != cy).sum()))
        for (x, y), (cx, cy) in zip(gpu.val_batches(CUDA), expected_val, strict=True):
            compared.append(((x - cx).abs().mean(), (y != cy).sum()))
    torch.cuda.synchronize()
    differences = [(float(mean), int(wrong)) for mean, wrong in compared]
    assert all(wrong == 0 for _, wrong in differences), differences
    # a batch from the wrong memory differs by about 0.3 (noise of std 50 around each class's
    # colour); the two decoders by a few levels of 255
    assert max(mean for mean, _ in differences) < 0.05, differences
