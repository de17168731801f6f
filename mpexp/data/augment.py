"""Training augmentation done on a batch where it lies (the GPU, or the CPU): a random crop from
the image padded with zeros, and a horizontal flip.

Each training sample's crop offset and flip are drawn once per epoch for the whole set, on the
CPU, from a generator seeded by (the run's seed, the epoch); a batch then takes its samples' draws
by their index in the set. So the same sample in the same epoch is cropped and flipped alike
whichever rank, loader or device takes it, and a resumed run gives the same batches as one never
interrupted. Cropping and flipping a batch is one gather over the padded batch: no Python per
sample and no read of a device value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# the augmentation's random stream of an epoch, apart from the one that orders the epoch
AUGMENT_STREAM = 1


def mixed_seed(*parts: int) -> int:
    """A 64-bit seed made from non-negative integers (the run's seed, an epoch, a sample): NumPy's
    SeedSequence hashes them, so that nearby tuples give unrelated random streams."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1, np.uint64)[0])


@dataclass(frozen=True)
class CropFlip:
    """`crop_padding` pixels of zeros around each image, then a window of the image's own size at
    a random offset (0: no crop); with `flip`, half of the images mirrored left to right."""

    crop_padding: int = 0
    flip: bool = False

    @property
    def active(self) -> bool:
        return self.crop_padding > 0 or self.flip

    def draws(self, n: int, seed: int, epoch: int, device: torch.device) -> torch.Tensor:
        """The epoch's draws for samples 0..n-1 of the set, n x 3 on `device`: the crop's row and
        column offsets into the padded image, and 1 where the image is flipped.

        Drawn on the CPU, so that every device gets the same ones, and moved once per epoch."""
        generator = torch.Generator().manual_seed(mixed_seed(seed, epoch, AUGMENT_STREAM))
        offsets = torch.randint(2 * self.crop_padding + 1, (n, 2), generator=generator)
        flips = torch.randint(2 if self.flip else 1, (n, 1), generator=generator)
        return torch.cat((offsets, flips), dim=1).to(device)

    def apply_(self, images: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
        """Crop and flip a batch (B x C x H x W, in any memory layout) in place, by its samples'
        rows of `draws` (B x 3, on the batch's device). In place, so that a captured CUDA graph's
        input tensor and a channels_last layout stay what they are."""
        b, c, h, w = images.shape
        p, device = self.crop_padding, images.device
        padded = F.pad(images, (p, p, p, p))
        rows = draws[:, :1] + torch.arange(h, device=device)
        columns = torch.arange(w, device=device)
        # a flip reads the window's columns right to left
        columns = draws[:, 1:2] + torch.where(draws[:, 2:].bool(), w - 1 - columns, columns)
        # one gather over each padded image's pixels, the same for every channel: on a CPU
        # several times faster than indexing by row, column and channel tensors
        pixels = rows.view(b, h, 1) * (w + 2 * p) + columns.view(b, 1, w)
        window = padded.reshape(b, c, -1).gather(2, pixels.view(b, 1, h * w).expand(b, c, h * w))
        return images.copy_(window.view(b, c, h, w))
