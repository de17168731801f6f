"""The schemas of the dataset group's options (conf/dataset/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from mpexp.config.choices import Loader

# Optional[...] rather than `X | None`: OmegaConf reads these annotations at runtime, and the
# `|` form is not understood there on every Python version the project supports.
# ruff: noqa: UP045


@dataclass
class DatasetConfig:
    _target_: str = MISSING
    batch_size: int = 256
    drop_last: bool = True
    loader: Loader = Loader.device
    num_workers: int = 2


@dataclass
class CropFlipConfig:
    """The training batches' augmentation, done on the device (mpexp/data/augment.py)."""

    crop_padding: int = 0  # zeros around each image, then a random crop of its size; 0: none
    flip: bool = False  # mirror half of the images left to right


@dataclass
class InMemoryDatasetConfig(DatasetConfig):
    augment: CropFlipConfig = field(default_factory=CropFlipConfig)


# Where downloaded datasets live: one folder per user, not a `data/` in every folder a run starts
# from; MPEXP_DATA_DIR moves it (a shared or faster disk), dataset.root=... overrides both
DATA_ROOT = "${oc.env:MPEXP_DATA_DIR,'~/.cache/mpexp/data'}"


@dataclass
class TorchvisionDatasetConfig(InMemoryDatasetConfig):
    root: str = DATA_ROOT
    download: bool = True


@dataclass
class SyntheticDatasetConfig(InMemoryDatasetConfig):
    train_size: int = 8192
    val_size: int = 1024
    channels: int = 1
    height: int = 28
    width: int = 28
    num_classes: int = 10
    noise: float = 0.8
    seed: int = 0


@dataclass
class ResizedCropFlipConfig(CropFlipConfig):
    """An image folder's augmentation: a random resized crop in the DataLoader's workers, then
    the in-memory sets' crop and flip on the device."""

    # the crop's share of the image's area, drawn from this range (aspect ratio 3/4 to 4/3); null:
    # no random crop, training images resized and centre-cropped as validation's are
    crop_scale: Optional[list[float]] = field(default_factory=lambda: [0.08, 1.0])
    flip: bool = True


@dataclass
class ImageFolderDatasetConfig:
    """dataset=image_folder: no `loader` key, for its images are always read by DataLoader
    workers."""

    _target_: str = MISSING
    path: Optional[str] = None  # train/, val/ (valid/) and test/ class folders, or ones to split
    val_fraction: float = 0.1  # of each class, where there is no val/
    split_seed: int = 0  # that split's draw: the same for every trainer.seed
    image_size: int = 224  # the square the model sees
    resize_size: Optional[int] = None  # validation's resize before its centre crop; null: 8/7 x
    mean: Optional[list[float]] = None  # per channel (RGB), in [0, 1]; null: computed at setup
    std: Optional[list[float]] = None
    stats_images: int = 1000  # training images the mean and std are computed from
    augment: ResizedCropFlipConfig = field(default_factory=ResizedCropFlipConfig)
    batch_size: int = 256
    drop_last: bool = True
    num_workers: int = 4
    cache: str = "none"  # resized: every image stored once, resized, and read without decoding
    cache_dir: str = "${oc.env:MPEXP_DATA_DIR,'~/.cache/mpexp/data'}/images"  # where it is kept
    cache_side: Optional[int] = None  # training's stored shorter side; null: what its crop needs
    decode: str = "cpu"  # gpu: JPEGs decoded on the CUDA device; auto: gpu for JPEGs on CUDA


TEXT_CACHE = "${oc.env:MPEXP_DATA_DIR,'~/.cache/mpexp/data'}/text"


@dataclass
class WindowsConfig:
    """Token windows of a text corpus (mpexp/data/text.py)."""

    _target_: str = MISSING
    # tokens a window gives the model; null: none known (a model's block_size, interpolated)
    block_size: Optional[int] = None
    train_size: int = 4096  # windows per epoch
    val_size: int = 256  # validation windows
    val_fraction: float = 0.1  # the corpus's tail that validates
    cache_dir: str = TEXT_CACHE  # where the token file and its key are written
    # byte (a vocabulary of 256), bpe (learned from the training part, vocab_size tokens), the
    # path of a Hugging Face tokenizer.json or of a folder holding one; null: byte
    tokenizer: Optional[str] = "byte"
    vocab_size: Optional[int] = None  # bpe's to learn; else null: the tokenizer's
    batch_size: int = 32
    drop_last: bool = True


@dataclass
class TextDatasetConfig(WindowsConfig):
    path: Optional[str] = None  # a UTF-8 file or a folder; null: Python's standard library


@dataclass
class DownloadedTextConfig(WindowsConfig):
    root: str = DATA_ROOT
    download: bool = True


@dataclass
class TokensDatasetConfig:
    """Pre-tokenized train.bin / val.bin in nanoGPT's layout (mpexp/data/tokens.py)."""

    _target_: str = MISSING
    path: Optional[str] = None  # the folder of train.bin and val.bin
    vocab_size: Optional[int] = None  # null: nanoGPT's meta.pkl's, else GPT-2's 50257
    dtype: Optional[str] = None  # uint16 or uint32; null: uint16 up to 65,536 tokens, else uint32
    bytes_per_token: Optional[float] = None  # of the text the tokens encode; null: no val/bpb
    block_size: Optional[int] = None
    train_size: int = 4096
    val_size: int = 256
    val_fraction: float = 0.1  # of train.bin, only where there is no val.bin
    batch_size: int = 32
    drop_last: bool = True
