"""What the two data sources share: the sample configuration they validate and decode against,
and the train loader that Lightning checkpoints.

A source is `MapStyleSource` (data/map_style.py: an index, batches planned per epoch) or
`StreamingSource` (data/webdataset_stream.py: shards streamed, batches formed on arrival). Both
have `setup(count_skipped) -> ShapeMix` (the shapes found, one row per distinct shape, for the
bucket table) and `train_loader(scheduling, num_replicas, rank, epoch_fn) -> TrainLoader`;
`AdaptiveLoadDataModule` picks one at setup and delegates to it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from torch.utils.data import DataLoader

from lightning_adaptiveload.data.collate import collate_samples
from lightning_adaptiveload.data.shards import check_config, decode_sample
from lightning_adaptiveload.scheduling.depth_choice import CHECKPOINTED_BATCH_KEY
from lightning_adaptiveload.scheduling.shapes import TokenSpec


@dataclass(frozen=True)
class SampleConfig:
    """What a valid sample is in this run: token spec, C of every latent, (L, D_text) of the
    batch's text, longest sample (tokens; None: no bound) and what happens to longer ones ("drop"
    or "resize"). Picklable, so DataLoader workers (also spawned ones) get it whole."""

    spec: TokenSpec
    latent_channels: int
    text_len: int
    text_dim: int
    max_seq_len: int | None
    oversize: str

    def check(self, key: str, channels: int, thw: tuple[int, int, int], text_dim_found: int | None
              ) -> tuple[tuple[int, int, int], int]:
        """(latent (T, H, W) to train on, its tokens) of a sample described by its header values;
        raises BadSample (shards.check_config)."""
        return check_config(key, channels, thw, text_dim_found, spec=self.spec, latent_channels=self.latent_channels,
                            text_dim=self.text_dim, max_seq_len=self.max_seq_len, oversize=self.oversize)

    def decode(self, key: str, files: dict[str, bytes]) -> dict:
        """Decoded and validated sample (shards.decode_sample); raises BadSample."""
        return decode_sample(key, files, spec=self.spec, latent_channels=self.latent_channels, text_len=self.text_len,
                             text_dim=self.text_dim, max_seq_len=self.max_seq_len, oversize=self.oversize)

    @property
    def collate(self) -> Callable[[list[dict]], dict]:
        """collate_samples for this text shape (a partial: picklable for worker processes)."""
        return partial(collate_samples, text_len=self.text_len, text_dim=self.text_dim)


class TrainLoader(DataLoader):
    """A DataLoader that Lightning checkpoints (state_dict / load_state_dict) and that moves its
    data to the trainer's epoch when iteration starts (`epoch_fn() -> int`; Lightning calls
    set_epoch only on a loader's sampler, not on an iterable dataset). Subclasses say what the
    state is and what an epoch leaves out."""

    def __init__(self, *args, epoch_fn: Callable[[], int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.epoch_fn = epoch_fn
        self.steps_taken = 0  # batches of this epoch handed out (workers may have prefetched more)
        # latent (T, H, W) -> blocks to checkpoint (the bucket's k under a memory plan), put into each
        # batch as CHECKPOINTED_BATCH_KEY; a shape not listed (or None) leaves the key out: every block
        self.depth_of_shape: dict[tuple[int, int, int], int] | None = None

    def _start_epoch(self, epoch: int | None) -> int:
        """Move to `epoch` (None: keep the current one); return the steps of it already taken."""
        raise NotImplementedError

    def _end_epoch(self) -> None:
        """Called after the last batch of an epoch."""

    def drop_counts(self) -> dict[str, int]:
        """Samples the current epoch leaves out, one entry per epoch_plan.DROP_COUNTERS key."""
        raise NotImplementedError

    def __iter__(self):
        self.steps_taken = self._start_epoch(self.epoch_fn() if self.epoch_fn is not None else None)
        depths = self.depth_of_shape
        for batch in super().__iter__():
            self.steps_taken += 1
            if depths and "latent_shape" in batch:
                k = depths.get(tuple(int(v) for v in batch["latent_shape"]))
                if k is not None:
                    batch[CHECKPOINTED_BATCH_KEY] = k
            yield batch
        self._end_epoch()

