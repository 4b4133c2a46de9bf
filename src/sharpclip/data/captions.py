"""Text-only batches: a list of captions, shuffled per epoch, sharded across ranks, resumable.

Used where no image is involved: the distillation of a text tower (CLIP-IN stage 1 / TULIP), which trains on long
captions alone. Each `Batch` has an empty `pixel_values` of shape (B, 0) and the captions tokenised to the
tokenizer's context (truncated with eos kept last). Ordering and sharding come from the same `GroupBatchSampler`
as image-caption data, so resuming works the same way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from sharpclip.data.sampling import GroupBatchSampler
from sharpclip.data.schema import Batch
from sharpclip.data.transforms import TextTokenizer


class CaptionLoader:
    """Batches of `batch_size` captions (this rank's share), in a seeded order per epoch; drops the last partial."""

    def __init__(
        self,
        captions: Sequence[str],
        tokenize: TextTokenizer,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        if len(captions) < batch_size * world_size:
            raise ValueError(f"{len(captions)} captions cannot fill one batch of {batch_size} on {world_size} ranks")
        self.captions, self.tokenize = list(captions), tokenize
        self.sampler = GroupBatchSampler(
            list(range(len(captions))), batch_size, seed=seed, rank=rank, world_size=world_size
        )

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Reseed the caption order for `epoch`."""
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        """The sampler's resume state: epoch, batches done, seed."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at the recorded epoch after the batches already done."""
        self.sampler.load_state_dict(state)

    def __iter__(self) -> Iterator[Batch]:
        for rows in self.sampler:
            ids, mask = self.tokenize([self.captions[i] for i in rows])
            yield Batch(
                ids=[f"caption-{i}" for i in rows],
                pixel_values=torch.empty(len(rows), 0),
                input_ids=ids,
                attention_mask=mask,
                groups=torch.tensor(rows),
            )
