"""What the calibration loop needs of the parts it is handed, as Protocols: the step runner, and the
DataModule in layers of capability (`AdaptiveLoadDataModule` has them all; a user's DataModule needs
only `CalibratedDataModule`, and gets the parts of calibration its methods allow)."""
from __future__ import annotations

from typing import Any, ContextManager, Protocol, runtime_checkable

import numpy as np


class Runner(Protocol):
    """calibration.runner.StepRunner: real training steps of the user's module, agreed across ranks."""

    device: Any
    is_global_zero: bool
    first_step_ms: float | None  # the process's first step, which no measurement counts (None before it)

    def measure(self, batch_fn, warmup: int, repeats: int, settle: bool = False, empty_cache: bool = False) -> dict:
        ...

    def agree(self, flag: bool) -> bool:
        ...

    def max_over_ranks(self, *values: float) -> list[float]:
        ...

    def broadcast(self, obj: Any) -> Any:
        ...


class Switch(Protocol):
    """checkpointing.BlockCheckpointing: how many of the model's L blocks a step checkpoints."""

    num_blocks: int

    def checkpointing(self, k: int) -> ContextManager:
        """Within it, the first k blocks are checkpointed."""


@runtime_checkable
class CalibratedDataModule(Protocol):
    """Enough to calibrate: batches of a bucket, the buckets, and a cost model to schedule with."""

    def synthetic_batch(self, seq_len_or_shape, batch_size: int) -> dict:
        ...

    def bucket_seq_lens(self) -> np.ndarray:
        ...

    def set_cost_model(self, cost_model, m_mem: int | None = None, policy: str | None = None) -> None:
        ...


@runtime_checkable
class ShapeListing(Protocol):
    """Lists the batch shapes training will run: calibration runs each of them before training."""

    def scheduled_batch_shapes(self) -> list:
        ...


@runtime_checkable
class MemoryPlanned(Protocol):
    """Takes a memory plan: per-bucket (B, k) from the fitted memory and time models."""

    def set_memory_plan(self, cost_model, memory_model, device_memory_bytes: float,
                        max_memory_fraction: float = 0.85, plan_margin: float = 0.0) -> None:
        ...


@runtime_checkable
class Replannable(Protocol):
    """Shows its buckets and takes a verification: the buckets whose scheduled shapes did not fit are
    planned again within the limits, and batches are priced with the measured times."""

    def bucket_table(self):
        ...

    def set_verification(self, verification) -> None:
        ...


def missing_methods(datamodule: object, protocol: type) -> list[str]:
    """The methods of `protocol` that `datamodule` lacks (for an error that names them)."""
    return [name for name in protocol.__dict__ if not name.startswith("_") and callable(getattr(protocol, name))
            and not callable(getattr(datamodule, name, None))]
