"""An image folder's host batches made what the step reads: on CUDA, each batch copied on a
stream of its own one batch ahead of the step; then the uint8 images converted to float32 in the
step's memory format, cropped and flipped on the device as the in-memory sets are
(mpexp/data/augment.py), and normalised."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mpexp.data.augment import CropFlip
from mpexp.data.base import Batch


class DeviceBatches:
    """Host batches of images, labels and indices to (inputs, targets) on the device, normalised
    by `mean` and `std` (per channel); a static batch, where the step asks for one, reused."""

    def __init__(
        self,
        device: torch.device,
        memory_format: torch.memory_format,
        batch_size: int,
        augment: CropFlip,
        mean: list[float],
        std: list[float],
    ):
        self.memory_format, self.batch_size, self.augment = memory_format, batch_size, augment
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # normalised as (x / 255 - mean) / std, with the 255 folded in
        shape = (1, 3, 1, 1)
        self.shift = torch.tensor(mean, device=device).mul(255).view(shape)
        self.scale = torch.tensor(std, device=device).mul(255).view(shape)
        self.static_batch: Batch | None = None

    def batches(
        self,
        batches: Iterator[tuple[torch.Tensor, ...]],
        device: torch.device,
        static: bool = False,
        draws: torch.Tensor | None = None,
    ) -> Iterator[Batch]:
        """Host batches made what the step reads. On CUDA each batch is copied on a stream of its
        own as soon as it is there, one batch ahead: the copy overlaps the step before it."""
        if self.copy_stream is None:
            for images, labels, index in batches:
                yield self._finish(images, labels, index, static, draws)
            return
        pending = None
        for batch in batches:
            with torch.cuda.stream(self.copy_stream):
                moved = [t.to(device, non_blocking=True) for t in batch]
                copied = torch.cuda.Event()
                copied.record(self.copy_stream)
            if pending is not None:
                yield self._arrived(*pending, static, draws)
            pending = moved, copied
        if pending is not None:
            yield self._arrived(*pending, static, draws)

    def _arrived(self, moved, copied, static: bool, draws) -> Batch:
        step_stream = torch.cuda.current_stream(moved[0].device)
        step_stream.wait_event(copied)
        for tensor in moved:  # used on the step's stream: not reused until it is done with them
            tensor.record_stream(step_stream)
        return self._finish(*moved, static, draws)

    def _finish(self, images, labels, index, static: bool, draws) -> Batch:
        """uint8 images to float32 in the step's memory format (into the static batch where one
        is asked for), cropped and flipped, then normalised."""
        if static and len(labels) == self.batch_size:
            if self.static_batch is None:
                self.static_batch = (self._new_images(images), labels.new_empty(len(labels)))
            out, targets = self.static_batch
            targets.copy_(labels)
        else:
            out, targets = self._new_images(images), labels
        out.copy_(images)
        if draws is not None:
            self.augment.apply_(out, draws[index])
        return out.sub_(self.shift).div_(self.scale), targets

    def _new_images(self, images: torch.Tensor) -> torch.Tensor:
        return torch.empty(
            images.shape,
            dtype=torch.float32,
            device=images.device,
            memory_format=self.memory_format,
        )
