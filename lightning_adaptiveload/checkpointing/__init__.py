"""Activation checkpointing switched per step, without changing the model's structure (switch.py)."""
from lightning_adaptiveload.checkpointing.switch import (
    BATCH_KEY, BlockCheckpointing, check_composition, checkpointed_from_batch, find_blocks, resolve_block_classes,
    select_instances,
)

__all__ = ["BATCH_KEY", "BlockCheckpointing", "check_composition", "checkpointed_from_batch", "find_blocks",
           "resolve_block_classes", "select_instances"]
