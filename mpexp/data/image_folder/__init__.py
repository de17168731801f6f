"""A folder of image files, in the layout torchvision's ImageFolder reads: one folder per class,
named after it. The images are decoded in DataLoader worker processes as batches are needed, so a
set of any size trains; only the list of files is held in memory.

`path/train/<class>/` and `path/val/<class>/` are the two splits (`valid/` or `validation/` in
place of `val/`). A folder of class folders alone (`path/<class>/`, or `path/train/<class>/`
without a validation folder) is split file by file: a file validates where a hash of
(`split_seed`, its path below the folder split) falls below `val_fraction`, so about that share of
each class validates. The split is the same for every run, whatever its `trainer.seed`, so that
seeds and precisions are compared on the same images, and a file added or removed moves no other
file between the splits. The run directory lists the validation files (`val_files.txt`). A folder
named as a split (`val/`, `test/`, ...) that holds folders of its own among the class folders to
split is refused: it would be trained as one more class. A `path/test/<class>/` beside `train/` is
evaluated once, when training ends, and reported apart (`test/acc`, `test/loss`).

A start walks the folder once, taking each file's size and modification time as it goes: the
split, the cache's key and the resume key are made from that walk. A checkpoint keeps the
folder's resume key (each class's files with their sizes and modification times, per split, and
the normalisation); a resume on a folder that has changed since (a file rewritten at the same
size too) is refused, naming what changed: an image moved between the splits would be validated
on after it was trained on. Symbolic links are followed within the folder; one that leads out of
it, or round in a loop, is refused.

An epoch's order is a seeded permutation of the training images, sharded across ranks as the
in-memory sets shard it (mpexp/data/base.py); a resumed run asks for the images from its batch on,
and no skipped image is decoded. The workers decode (Pillow; a JPEG much larger than needed at a
reduced scale) and take a random resized crop of each training image, seeded by the run's seed,
the epoch and the image's index, so that an image gets the same crop whichever worker takes it and
whether or not the run was resumed; validation images are resized and centre-cropped.
Batches travel as uint8 in pinned memory; on the device they are converted to float32 in the step's
memory format, cropped and flipped as the in-memory sets are (mpexp/data/augment.py) and normalised.
On CUDA the next batch is copied on a stream of its own while the current step runs.

Where decoding cannot keep up with the step, two other ways in: `dataset.cache=resized` reads every
image from a store of resized pixels built once and shared by every process that asks
(mpexp/data/image_cache.py), `dataset.decode=gpu` has the workers read the JPEGs' bytes and
decodes them on the GPU (mpexp/data/gpu_decode.py). Both hook in at `Split.read`; `ran.data.cache`
and `ran.data.decode` record which ran.

Images are decoded upright (their EXIF orientation applied). An image that cannot be decoded is
replaced by the next image of its split that can, counted, named in a warning once and recorded in
`ran.data.undecodable`: a damaged file among many does not stop a long run, and every run on the
same files sees the same images. A class none of whose images decodes stops the run, named. A read
that fails with a transient error (EIO, EAGAIN, a stale network handle) is tried again before the
image counts as damaged.

The rooms: layout.py walks the folder and refuses the layouts that would mislead; val_split.py
splits a folder of classes by hash; reading.py decodes a split's images in the workers and notes
the ones that cannot be; stores.py opens the stores of resized images; loaders.py holds the
DataLoaders; normalisation.py computes the mean and std where they are not given;
device_batches.py puts the batches on the device; dataset.py is `ImageFolderData`, which composes
them.
"""

from mpexp.data.image_folder.dataset import ImageFolderData

__all__ = ["ImageFolderData"]
