"""What the data costs, apart from the step: the in-memory sets' augmentation on the device, and a
folder of images read by each of its paths (docs/benchmarks.md, "Data").

    python scripts/data_bench.py augment                     # one epoch of synthetic_cifar10
    python scripts/data_bench.py folder --workers 0 1 2      # generated 500x375 JPEGs at 224 px
    python scripts/data_bench.py folder --tiny --workers 0 1 2   # 32x32 PNGs at 32 px
    python scripts/data_bench.py paths --workers 1 2 --step resnet18   # each path beside a step
    python scripts/data_bench.py large                       # a 12-megapixel JPEG, draft mode
    python scripts/data_bench.py start --files 100000        # what a start costs per file
    python scripts/data_bench.py start --files 10000 --file-kb 110   # ImageNet's JPEG sizes

`paths` times the training images per second of each way the image folder can be read: decoded
by 1 and 2 DataLoader workers, from the resized cache (dataset.cache=resized, at its default size
and at cache_side=256; its one-time build timed apart), decoded on the GPU (dataset.decode=gpu,
where CUDA is), taken in turn --repeats times; then, with --step, the training step's own images
per second for torchvision's model at the same size (fp32 here; on CUDA, bf16 autocast too). A
path that reads fewer images per second than the step takes leaves the step waiting: the run's
perf/data_wait_share says by how much.

`start` times what an image folder's start costs before any image is decoded, on --files files in
100 class folders (empty, or of random bytes of about --file-kb KiB): the one walk (each file's
directory entry and stat), the split, the content digests (mpexp/data/file_digest.py), the resume
key and the cache's keys; the digests alone; and one more pass of stats over the same files,
which the start made before it walked once (a second and third stat of every file).

The main process runs on one thread, as it would beside a training step; `folder` and `paths`
write their images once into --dir (a temporary folder by default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from mpexp.data.image_folder import ImageFolderData
from mpexp.data.image_folder.reading import decode
from mpexp.data.synthetic import SyntheticData

CPU = torch.device("cpu")


def augment_cost(repeats: int) -> None:
    """One epoch of synthetic_cifar10's training batches (50,000 x 3 x 32 x 32, batch 128, the
    static batch a captured step reads), without and with crop_padding=4 and flip; the best of
    `repeats` each, taken in turn."""
    best: dict[str, float] = {}
    settings = {"off": None, "crop_padding=4 flip": {"crop_padding": 4, "flip": True}}
    for repeat in range(repeats):
        for name, augment in settings.items():
            data = SyntheticData(train_size=50000, val_size=16, channels=3, height=32, width=32,
                                 batch_size=128, augment=augment)  # fmt: skip
            data.setup(CPU)
            began = time.perf_counter()
            for _ in data.train_batches(repeat + 1, 0, CPU, static=True):
                pass
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - began)
    for name, seconds in best.items():
        print(f"augment {name}: {seconds:.2f} s per epoch of 390 batches")


def write_folder(root: Path, tiny: bool) -> None:
    """Two classes of smooth random images: 500x375 JPEGs (about 60 KB, like photographs) or
    32x32 PNGs (CIFAR-10's size)."""
    rng = np.random.default_rng(0)
    (w, h), suffix, count = ((32, 32), "png", 2048) if tiny else ((500, 375), "jpg", 512)
    for split, n in (("train", count), ("val", 64)):
        for name in ("a", "b"):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n // 2):
                coarse = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
                image = Image.fromarray(coarse).resize((w, h), Image.BICUBIC)
                image.save(folder / f"{i}.{suffix}", quality=90)


def folder_rate(root: Path, size: int, workers: int, device: torch.device = CPU, **kwargs) -> float:
    """Training images per second through ImageFolderData.train_batches: the second epoch."""
    data = ImageFolderData(path=str(root), image_size=size, batch_size=64, num_workers=workers,
                           mean=[0.5] * 3, std=[0.25] * 3, **kwargs)  # fmt: skip
    data.setup(device)
    for epoch in (1, 2):  # the first starts the workers
        began = time.perf_counter()
        images = 0
        for _, labels in data.train_batches(epoch, 0, device):
            images += len(labels)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - began
    return images / seconds


def read_paths(root: Path, size: int, workers: list[int], repeats: int) -> None:
    """Images per second of each way of reading the folder, taken in turn, `repeats` times: the
    median and the range."""
    cache_dir = root / "cache"
    began = time.perf_counter()
    cached = ImageFolderData(path=str(root), image_size=size, num_workers=max(workers),
                             mean=[0.5] * 3, std=[0.25] * 3, cache="resized",
                             cache_dir=str(cache_dir))  # fmt: skip
    cached.setup(CPU)
    built = time.perf_counter() - began
    print(f"resized cache built in {built:.1f} s with {max(workers)} workers (both splits, once)")
    paths = {f"decoded by {n} worker(s)": (n, CPU, {}) for n in workers}
    paths |= {f"resized cache, {n} worker(s)": (n, CPU, {"cache": "resized",
              "cache_dir": str(cache_dir)}) for n in workers}  # fmt: skip
    # training's images at 256 px: the smaller store, its small crops enlarged from fewer pixels
    paths |= {f"resized cache at cache_side=256, {n} worker(s)": (n, CPU, {"cache": "resized",
              "cache_dir": str(cache_dir), "cache_side": 256}) for n in workers}  # fmt: skip
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        paths |= {f"decoded on the GPU, {n} worker(s) reading": (n, cuda, {"decode": "gpu"})
                  for n in workers}  # fmt: skip
    rates: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, (n, device, kwargs) in paths.items():
            rates[name].append(folder_rate(root, size, n, device, **kwargs))
    for name, taken in rates.items():
        print(f"{name}: {statistics.median(taken):.0f} images/s "
              f"({min(taken):.0f} to {max(taken):.0f}, {len(taken)} repeats)")  # fmt: skip


def step_rate(model_name: str, size: int, batch: int, steps: int) -> None:
    """The training step's own images per second (forward, backward, SGD) for torchvision's
    `model_name` at `size` pixels on random images: the median of `steps` steps after a warm-up;
    the process's threads all used, as training uses them."""
    import torchvision

    torch.set_num_threads(os.cpu_count() or 1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = getattr(torchvision.models, model_name)(num_classes=2).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    images = torch.randn(batch, 3, size, size, device=device)
    labels = torch.randint(0, 2, (batch,), device=device)
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    for dtype in dtypes:
        times = []
        for _ in range(steps + 1):
            began = time.perf_counter()
            with torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
                loss = torch.nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - began)
        median = statistics.median(times[1:])
        print(f"step: {model_name} at {size} px, batch {batch}, {str(dtype)[6:]} on "
              f"{device.type}: {batch / median:.1f} images/s ({median:.2f} s a step, median of "
              f"{steps})")  # fmt: skip


def per_image(root: Path, size: int) -> tuple[float, float]:
    """Milliseconds per training image to decode it and to take its random resized crop."""
    data = ImageFolderData(path=str(root), image_size=size, num_workers=0, mean=[0.5] * 3,
                           std=[0.25] * 3)  # fmt: skip
    data.setup(CPU)
    split = data.splits["train"]
    crop, least = split.views["train"]
    paths = [split.path(i) for i in range(min(200, len(split)))]
    began = time.perf_counter()
    images = [decode(path, least) for path in paths]
    decoding = (time.perf_counter() - began) / len(paths)
    began = time.perf_counter()
    for image in images:
        crop(image)
    return decoding * 1e3, (time.perf_counter() - began) / len(paths) * 1e3


def large_jpeg(root: Path, repeats: int) -> None:
    """Decoding a 4000x3000 JPEG whole, and at the sizes a 224-pixel run needs it (training's
    random resized crop: 792 pixels; validation's resize: 256), which draft mode decodes at 1/2
    and 1/8 of its size."""
    rng = np.random.default_rng(0)
    coarse = rng.integers(0, 256, (376, 501, 3), dtype=np.uint8)
    path = root / "large.jpg"
    Image.fromarray(coarse).resize((4000, 3000), Image.BICUBIC).save(path, quality=90)
    for least in (None, 792, 256):
        decode(str(path), least)
        began = time.perf_counter()
        for _ in range(repeats):
            shape = tuple(decode(str(path), least).shape)
        seconds = (time.perf_counter() - began) / repeats
        print(f"needed at {least or 'full size'}: decoded to {shape} in {seconds * 1e3:.0f} ms")


def start_cost(root: Path, files: int, repeats: int, file_kb: float = 0.0) -> None:
    """A start's walk, split, content digests and keys on `files` files of about `file_kb` KiB
    of random bytes each (empty ones by default), the digests alone, and one more stat pass."""
    from mpexp.data.file_digest import file_digests
    from mpexp.data.image_cache import ResizedImages, file_stats

    if not root.is_dir() or sum(1 for _ in root.rglob("*.jpg")) != files:
        rng = np.random.default_rng(0)
        for i in range(files):
            folder = root / f"class{i % 100:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            size = int(file_kb * 1024 * rng.uniform(0.5, 1.5))  # JPEGs' sizes spread so
            (folder / f"{i:07d}.jpg").write_bytes(rng.bytes(size))
    walks, digests, passes = [], [], []
    for _ in range(repeats):  # interleaved: the machine's load falls on all alike
        began = time.perf_counter()
        data = ImageFolderData(path=str(root), image_size=224, mean=[0.5] * 3, std=[0.5] * 3)
        data._find_splits()
        data.resume_key()
        for split in data.splits.values():
            paths = split.paths()
            ResizedImages(paths, split.stats, 792, False, root, "x", decode, split.contents).key()
        walks.append(time.perf_counter() - began)
        every = list(data.splits.values())
        paths = [p for s in every for p in s.paths()]
        began = time.perf_counter()
        file_digests(paths, np.concatenate([s.stats[:, 0] for s in every]))
        digests.append(time.perf_counter() - began)
        began = time.perf_counter()
        file_stats(paths)
        passes.append(time.perf_counter() - began)
    walk, digest, extra = (statistics.median(t) for t in (walks, digests, passes))
    print(
        f"{files:,} files of about {file_kb:g} KiB: a start's walk, split, digests and keys "
        f"{walk:.2f} s (median of {repeats}; {walk / files * 1e6:.1f} us a file, "
        f"{walk / files * 1e6:.0f} s a million files); load {os.getloadavg()[0]:.1f}"
    )
    print(f"of which the content digests: {digest:.2f} s ({digest / files * 1e6:.1f} us a file)")
    print(f"one more stat of every file: {extra:.2f} s ({extra / files * 1e6:.1f} us a file)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["augment", "folder", "paths", "large", "start"])
    parser.add_argument("--files", type=int, default=100_000, help="start: files")
    parser.add_argument("--file-kb", type=float, default=0.0, help="start: their size, KiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="32x32 PNGs at 32 px")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--dir", type=Path, help="where the images are written (kept)")
    parser.add_argument("--step", help="paths: a torchvision model whose step to time, resnet18")
    parser.add_argument("--step-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after a warm-up")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.what == "augment":
        augment_cost(args.repeats)
        return
    with tempfile.TemporaryDirectory() as scratch:
        root = args.dir or Path(scratch)
        if args.what == "large":
            large_jpeg(root, args.repeats)
            return
        if args.what == "start":
            start_cost(root, args.files, args.repeats, args.file_kb)
            return
        if not (root / "train").is_dir():
            write_folder(root, args.tiny)
        size = 32 if args.tiny else 224
        if args.what == "paths":
            read_paths(root, size, args.workers, args.repeats)
            if args.step:
                step_rate(args.step, size, args.step_batch, args.steps)
            return
        decoding, cropping = per_image(root, size)
        print(f"per image: decode {decoding:.2f} ms, random resized crop {cropping:.2f} ms")
        for workers in args.workers:
            rate = folder_rate(root, size, workers)
            print(f"num_workers={workers}: {rate:.0f} images/s")


if __name__ == "__main__":
    main()
