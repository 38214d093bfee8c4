"""PerBucketCheckpointing: checkpoint as many of the model's blocks per step as the batch asks.

The DataModule puts the bucket's depth k into each batch (`batch["ac_blocks"]`, from the bucket
table; docs/memory.md); before each training step this callback checkpoints the first k blocks and
runs the rest plainly (lightning_adaptiveload.checkpointing). A batch without the key checkpoints
every block. Blocks are named by class, as in Lightning's `activation_checkpointing_policy`; when
the strategy has such a policy and no classes are given here, its classes are taken and the
strategy's own checkpointing is switched off, so no block is checkpointed twice.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_adaptiveload.checkpointing import (
    BATCH_KEY, BlockCheckpointing, check_composition, checkpointed_from_batch, find_blocks, resolve_block_classes,
    select_instances,
)


def take_over_strategy_checkpointing(strategy, block_classes: tuple[type[nn.Module], ...] | None
                                     ) -> Callable[[nn.Module], bool] | None:
    """The block selection of `strategy`'s activation-checkpointing policy (Lightning's FSDPStrategy
    keeps it in `_activation_checkpointing_kwargs` and applies it after wrapping the model), which is
    then emptied so the strategy does not checkpoint the blocks as well. None if the strategy has no
    such policy. ValueError if it selects blocks by a rule this cannot read (a custom wrap policy),
    or other classes than `block_classes`."""
    kwargs = getattr(strategy, "_activation_checkpointing_kwargs", None)
    if not kwargs:
        return None
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    policy = kwargs.get("auto_wrap_policy")
    if "check_fn" in kwargs:  # the deprecated activation_checkpointing=[classes]
        select, classes = kwargs["check_fn"], None
    elif isinstance(policy, ModuleWrapPolicy):  # activation_checkpointing_policy={classes}
        classes = tuple(policy._module_classes)
        select = select_instances(classes)
    else:
        raise ValueError(f"PerBucketCheckpointing cannot read the strategy's activation_checkpointing_policy "
                         f"({policy!r}); give the strategy a set of block classes, or give block_classes here and "
                         f"remove the strategy's policy")
    if block_classes is not None and (classes is None or set(classes) != set(block_classes)):
        raise ValueError(f"PerBucketCheckpointing(block_classes={[c.__name__ for c in block_classes]}) and the "
                         f"strategy's activation_checkpointing_policy name different blocks; give them in one place")
    strategy._activation_checkpointing_kwargs = {}
    return select


class PerBucketCheckpointing(Callback):
    """Switch activation checkpointing of the model's blocks per training step.

    block_classes: the blocks to checkpoint, as classes or import paths ("pkg.module.Class"), or
        None to take the classes of the strategy's `activation_checkpointing_policy`.
    batch_key: the batch entry (a Mapping batch) holding how many blocks to checkpoint; the first k
        blocks in registration order are checkpointed, the last L - k are not (why: docs/memory.md).
    save_attention: a checkpointed block keeps the outputs of torch's fused attention kernels, so
        backward recomputes it without its attention (selective checkpointing; the trade, measured:
        lightning_adaptiveload/checkpointing/switch.py); False recomputes the whole block.

    List it after callbacks that patch the blocks' forward (FusedAdaLNSurgery) and before
    CostModelCalibration. `switch` (a BlockCheckpointing) is available from `setup` on, or from
    `on_fit_start` for models built in `configure_model`.
    """

    def __init__(self, block_classes: type | str | Iterable[type | str] | None = None,
                 batch_key: str = BATCH_KEY, save_attention: bool = True) -> None:
        self.block_classes = None if block_classes is None else resolve_block_classes(block_classes)
        self.batch_key = batch_key
        self.save_attention = bool(save_attention)
        self.switch: BlockCheckpointing | None = None
        self._select: Callable[[nn.Module], bool] | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # before the strategy wraps the model: its own checkpointing must be disarmed now
        select = take_over_strategy_checkpointing(trainer.strategy, self.block_classes)
        if select is None:
            if self.block_classes is None:
                raise ValueError("PerBucketCheckpointing needs block_classes, or a strategy with an "
                                 "activation_checkpointing_policy naming the block classes")
            select = select_instances(self.block_classes)
        self._select = select
        self._wrap(pl_module)

    def _wrap(self, pl_module: LightningModule) -> None:
        blocks = find_blocks(pl_module, self._select)
        if blocks:
            self.switch = BlockCheckpointing(blocks, save_attention=self.save_attention)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.switch is None:  # the model was built in configure_model, after setup
            self._wrap(pl_module)
        if self.switch is None:
            raise ValueError(f"PerBucketCheckpointing found no block to checkpoint in {type(pl_module).__name__} "
                             f"(block_classes={self.block_classes})")
        model = trainer.strategy.model
        check_composition(pl_module if model is None else model, self.switch)
        self.switch.set_checkpointed(self.switch.num_blocks)
        rank_zero_info(f"PerBucketCheckpointing: {self.switch.num_blocks} switchable blocks "
                       f"({type(self.switch.blocks[0]).__name__}); batch[{self.batch_key!r}] = blocks to checkpoint")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self.switch.set_checkpointed(checkpointed_from_batch(batch, self.switch.num_blocks, self.batch_key))

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.switch.set_checkpointed(self.switch.num_blocks)  # later use without the key: the safe default
