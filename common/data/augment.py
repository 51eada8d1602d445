"""Batch transforms of training inputs, on the client's device: no PIL, no per-sample loop.

``crop_flip`` is the CIFAR augmentation of FedBABU's code (Oh et al., ICLR 2022, after
LG-FedAvg's: torchvision's ``RandomCrop(32, padding=4)`` then ``RandomHorizontalFlip()``): every
image of a batch is padded by 4 zeros on each side, cropped back to its own size at a uniformly
random offset (0 to 8 on each axis) and mirrored left-right with probability 1/2. It is one
gather over the whole batch with per-image index arithmetic. The inputs here are already
normalised, so the zero padding is the dataset's mean colour, where torchvision pads the raw
image with black before normalising.

The draws come from the transform's own generator, on the batch's device, seeded from the
training plan's seed: the generator of the batch order is another one, so switching augmentation
on changes the inputs, never which samples form a batch.
"""

from __future__ import annotations

import torch

from fedpart.common.wire.codecs import seeded_generator

AUGMENTATIONS = ("none", "crop_flip")
PADDING = 4
STREAM = 1  # second key of the augmentation's seed, after the plan's seed


def crop_flip(x: torch.Tensor, row_offsets: torch.Tensor, col_offsets: torch.Tensor, flips: torch.Tensor,
              padding: int = PADDING) -> torch.Tensor:
    """Images ``x`` ``[B, C, H, W]`` zero-padded by ``padding`` on each side, image ``b`` cropped
    to ``H x W`` from row ``row_offsets[b]`` and column ``col_offsets[b]`` of its padded copy
    (in ``[0, 2 padding]``), then mirrored left-right where ``flips[b]``. A new tensor."""
    if x.dim() != 4:
        raise ValueError(f"crop_flip transforms image batches [B, C, H, W], got shape {list(x.shape)}")
    batch, channels, height, width = x.shape
    rows = row_offsets[:, None] - padding + torch.arange(height, device=x.device)   # [B, H] source rows
    cols = col_offsets[:, None] - padding + torch.arange(width, device=x.device)    # [B, W] source columns
    cols = torch.where(flips[:, None], cols.flip(1), cols)
    inside = (((rows >= 0) & (rows < height))[:, :, None] & ((cols >= 0) & (cols < width))[:, None, :])
    source = rows.clamp(0, height - 1)[:, :, None] * width + cols.clamp(0, width - 1)[:, None, :]
    out = x.reshape(batch, channels, height * width).gather(
        2, source.reshape(batch, 1, height * width).expand(batch, channels, height * width))
    return out.view(batch, channels, height, width).masked_fill_(~inside[:, None], 0)


class CropFlip:
    """:func:`crop_flip` at random offsets and flips, drawn from a generator of its own seeded
    from ``seed`` (made on the first batch's device)."""

    def __init__(self, seed: int, padding: int = PADDING) -> None:
        self.seed = seed
        self.padding = padding
        self.generator: torch.Generator | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.generator is None:
            self.generator = seeded_generator(self.seed, STREAM, device=x.device)
        offsets = torch.randint(0, 2 * self.padding + 1, (2, x.shape[0]), generator=self.generator, device=x.device)
        flips = torch.randint(0, 2, (x.shape[0],), generator=self.generator, device=x.device).bool()
        return crop_flip(x, offsets[0], offsets[1], flips, self.padding)


def build_augment(name: str, seed: int) -> CropFlip | None:
    """The batch transform ``name`` (``train.augment``) drawing from a stream seeded by ``seed``
    (the training plan's); None for ``none``."""
    if name == "none":
        return None
    if name == "crop_flip":
        return CropFlip(seed)
    raise ValueError(f"unknown augmentation {name!r}; known: {', '.join(AUGMENTATIONS)}")
