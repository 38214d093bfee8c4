"""Run by tests/checkpointing/test_distributed.py: 2 CPU processes (gloo) train the toy model for a few SGD
steps under DDP, FSDP (FullyShardedDataParallel, one unit per block) and FSDP2 (fully_shard per block), each
rank with its own per-step checkpointing depth, and write per rank what the test compares:

  plain     no checkpointing (the numerical reference)
  switched  BlockCheckpointing with a different k per rank and step
  static    torch's CheckpointWrapper on the first STATIC_K blocks (the same k on both ranks: a wrapper
            outside an FSDP unit all-gathers again when it recomputes, so unequal static depths would hang)
  switched_static  BlockCheckpointing at STATIC_K on both ranks

Usage: python tests/checkpointing/distributed_script.py OUT_DIR PORT
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lightning_adaptiveload.checkpointing import (  # noqa: E402
    BlockCheckpointing, check_composition, find_blocks, select_instances,
)
from tests.checkpointing.toy import ToyBlock, ToyNet, toy_batch  # noqa: E402

DEPTH = 4
SCHEDULE = {0: [0, 3, 4, 1], 1: [4, 1, 0, 2]}  # blocks checkpointed per step, per rank
STATIC_K = 2
WATCHDOG_S = 120
MODES = ("ddp", "fsdp", "fsdp2")


def build(mode: str, variant: str):
    """(wrapped model, switch or None, the unwrapped net)."""
    torch.manual_seed(0)
    net = ToyNet(depth=DEPTH).double()
    switch = None
    if variant in ("switched", "switched_static"):
        switch = BlockCheckpointing(find_blocks(net, select_instances([ToyBlock])))
    if variant == "static" and mode != "fsdp":  # before wrapping; FSDP1 gets it after wrapping (Lightning's order)
        _static_checkpointing(net)
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(net)
    elif mode == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        model = FullyShardedDataParallel(net, auto_wrap_policy=ModuleWrapPolicy({ToyBlock}),
                                         device_id=torch.device("cpu"))
        if variant == "static":
            _static_checkpointing(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for block in list(net.blocks):
            fully_shard(block)
        model = fully_shard(net)
    if switch is not None:
        check_composition(model, switch)
    return model, switch, net


def _static_checkpointing(root) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    first = set(list(find_blocks(root, select_instances([ToyBlock])))[:STATIC_K])
    apply_activation_checkpointing(root, check_fn=lambda m: m in first)


def full_params(mode: str, model, net) -> dict[str, list]:
    """Every parameter, unsharded, under its plain name (torch's CheckpointWrapper adds a prefix)."""
    def plain(name: str) -> str:
        return name.replace("._checkpoint_wrapped_module", "")

    if mode == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel
        with FullyShardedDataParallel.summon_full_params(model):
            return {plain(n): p.detach().clone().flatten().tolist() for n, p in net.named_parameters()}
    if mode == "fsdp2":
        return {plain(n): p.full_tensor().detach().flatten().tolist() for n, p in net.named_parameters()}
    return {plain(n): p.detach().flatten().tolist() for n, p in net.named_parameters()}


def train(mode: str, variant: str, rank: int) -> dict:
    model, switch, net = build(mode, variant)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    blocks = find_blocks(model, select_instances([ToyBlock]))  # the blocks themselves, inside any wrapper
    losses, calls = [], []
    for step, k in enumerate(SCHEDULE[rank]):
        if variant == "switched":
            switch.set_checkpointed(k)
        elif variant == "switched_static":
            switch.set_checkpointed(STATIC_K)
        for block in blocks:
            block.calls = 0
        x, context = toy_batch(seed=1000 * rank + step)
        torch.manual_seed(100 * rank + step)  # dropout masks: the same in every variant
        loss = model(x, context).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        calls.append([b.calls for b in blocks])
    return {"losses": losses, "calls": calls, "params": full_params(mode, model, net)}


def inner_unit_refused() -> str:
    """FSDP units inside the blocks (every Linear its own unit): check_composition must refuse."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    torch.manual_seed(0)
    net = ToyNet(depth=DEPTH).double()
    switch = BlockCheckpointing(find_blocks(net, select_instances([ToyBlock])))
    model = FullyShardedDataParallel(net, auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
                                     device_id=torch.device("cpu"))
    try:
        check_composition(model, switch)
    except ValueError as e:
        return str(e)
    return ""


def main(rank: int, out: str, port: int) -> None:
    warnings.filterwarnings("ignore", message=".*returned a view tensor")  # FSDP2 on the toy head's output
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)  # a hang ends with every thread's stack
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    result = {mode: {variant: train(mode, variant, rank) for variant in ("plain", "switched", "static",
                                                                         "switched_static")}
              for mode in MODES}
    result["inner_unit_error"] = inner_unit_refused()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.spawn(main, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
