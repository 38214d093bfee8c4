"""StepRunner's steps hold what Lightning's training steps hold (the previous step's gradients during
the forward, through the backward when accumulating) and agree on an out-of-memory error across
ranks after the forward and after the backward: on a CPU with a minimal strategy, and in a 2-process
gloo group where one rank alone runs out of memory."""
import multiprocessing as mp
import os
import types

import pytest
import torch
import torch.distributed as dist

from lightning_adaptiveload.calibration.runner import StepRunner


class Strategy:
    """The part of a Lightning strategy StepRunner uses; reduce all-reduces when a group is up, and
    post_backward all-reduces the gradients as DDP does (a collective a rank must not miss)."""

    def __init__(self, module):
        self.module, self.root_device = module, torch.device("cpu")

    def training_step(self, batch):
        return self.module.training_step(batch)

    def batch_to_device(self, batch):
        return batch

    def pre_backward(self, loss):
        self.module.at_pre_backward.append(all(p.grad is not None for p in self.module.parameters()))

    def post_backward(self, loss):
        if dist.is_initialized():
            for p in self.module.parameters():
                dist.all_reduce(p.grad)

    def reduce(self, value, reduce_op="max"):
        if dist.is_initialized():
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value

    def broadcast(self, obj):
        return obj


class Tiny(torch.nn.Module):
    """A LightningModule's surface: training_step; records whether every parameter had a gradient at
    each forward and at each pre_backward."""

    def __init__(self, fail_at_forward: int | None = None):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.at_forward, self.at_pre_backward = [], []
        self.fail_at_forward = fail_at_forward

    def training_step(self, batch):
        self.at_forward.append(all(p.grad is not None for p in self.parameters()))
        if self.fail_at_forward is not None and len(self.at_forward) == self.fail_at_forward:
            raise torch.OutOfMemoryError("fake: out of memory on this rank alone")
        return self.linear(batch).square().mean()


def runner_for(module, accumulate=1, world_size=1, rank=0):
    trainer = types.SimpleNamespace(strategy=Strategy(module), optimizers=[], accumulate_grad_batches=accumulate,
                                    world_size=world_size, is_global_zero=rank == 0)
    runner = StepRunner(trainer, module)
    return runner


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_previous_steps_gradients_are_held_during_forward_as_in_lightning(accumulate):
    module = Tiny()
    runner = runner_for(module, accumulate)
    module.log = module.log_dict = None  # StepRunner replaces and deletes them
    with runner:
        out = runner.measure(lambda: torch.randn(4, 8), warmup=1, repeats=2)
    assert out["status"] == "ok"
    # every forward, the first included, runs with gradients allocated (the step before's); the runner's
    # first measurement is preceded by one uncounted step
    assert module.at_forward == [True] * 4
    # without accumulation Lightning's zero_grad (set to None) runs between forward and backward;
    # accumulating, a micro-batch after the first backpropagates into the held gradients
    assert module.at_pre_backward == [accumulate > 1] * 4
    assert all(p.grad is None for p in module.parameters())  # leaving the runner drops them


def _rank(rank: int, port: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        module = Tiny(fail_at_forward=3 if rank == 1 else None)  # rank 1 alone, at its second measured step
        module.log = module.log_dict = None
        runner = runner_for(module, world_size=2, rank=rank)
        with runner:
            first = runner.measure(lambda: torch.randn(4, 8), warmup=1, repeats=2)
            module.fail_at_forward = None
            second = runner.measure(lambda: torch.randn(4, 8), warmup=0, repeats=1)  # collectives still line up
        results[rank] = (first, second["status"], len(module.at_forward))
    finally:
        dist.destroy_process_group()


def test_an_out_of_memory_step_on_one_rank_is_agreed_on_by_every_rank_without_a_hang():
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = 29500 + os.getpid() % 2000
        procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
        assert not hung, "a rank hung in a collective"
        assert all(p.exitcode == 0 for p in procs)
        results = dict(results)
    for rank in (0, 1):
        first, second, forwards = results[rank]
        assert first == {"status": "oom"} and second == "ok"
        assert forwards == 4  # the uncounted first step, then both stopped after the second forward, then one more


class FirstStepHoldsMore(Tiny):
    """A process's first step: it saves one-time bytes for backward (a workspace made once), later steps do not."""

    def training_step(self, batch):
        loss = super().training_step(batch)
        if len(self.at_forward) == 1:
            loss = loss + torch.ones(4096, requires_grad=True).pow(2).sum() * 0.0  # pow saves its 16 KiB input
        return loss


def test_the_runners_first_step_is_not_measured_and_a_later_measurement_takes_one_step_less():
    """The one-time bytes of the first step are in no measurement's peak (CPU: bytes saved for backward, fp64
    reference: the same measurement on a module without them), and only the first measurement pays the extra step."""
    def measured(module_type):
        torch.manual_seed(0)
        module = module_type()
        module.log = module.log_dict = None
        runner = runner_for(module)
        with runner:
            first = runner.measure(lambda: torch.randn(4, 8), warmup=0, repeats=1)
            steps_after_first = len(module.at_forward)
            second = runner.measure(lambda: torch.randn(4, 8), warmup=0, repeats=1)
        return first, second, steps_after_first, len(module.at_forward)

    ref_first, _, _, _ = measured(Tiny)
    first, second, steps_after_first, steps = measured(FirstStepHoldsMore)
    assert steps_after_first == 2 and steps == 3  # uncounted + measured, then one measured
    assert first["peak_bytes"] == ref_first["peak_bytes"] == second["peak_bytes"] > 0


@pytest.mark.cuda
def test_on_cuda_the_held_gradients_add_their_bytes_to_the_peak():
    """The peak of a measured step exceeds that of a step whose gradients were dropped before its
    forward by most of the gradient bytes. The measured step's peak is at its forward's end:
    parameters, gradients (held) and every activation. The dropped step's is at its backward's start
    (parameters, activations and a few activation-sized temporaries), when the activations of a
    layer (4096 rows x 1024: 16.8 MB) outweigh its gradients (4.2 MB): backward then frees more each
    layer than it allocates. So held - dropped = the gradients (64 layers: 269 MB) less a few
    temporaries (~50 MB). The H200 runs of 2026-12-03 sized it wrongly twice: 8 layers of 4096
    rows measured no difference, 16 layers of 1024 rows x 2048 measured 84 MB of 269 (gradients larger
    than activations per layer: the dropped step's backward peak, at its end, holds them all)."""
    device = torch.device("cuda")
    module = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(64)]).to(device)
    module.training_step = lambda batch: module(batch).square().mean()
    module.log = module.log_dict = None
    module.at_pre_backward = []
    trainer = types.SimpleNamespace(strategy=Strategy(module), optimizers=[], accumulate_grad_batches=1,
                                    world_size=1, is_global_zero=True)
    trainer.strategy.root_device = device
    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    batch = torch.randn(4096, 1024, device=device)
    with StepRunner(trainer, module) as runner:
        held = runner.measure(lambda: batch, warmup=0, repeats=1, empty_cache=True)["peak_bytes"]
        runner.zero_grad()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss = module.training_step(batch)  # the reference: forward and backward with no gradients held
        loss.backward()
        del loss
        dropped = torch.cuda.max_memory_allocated()
    assert 0.5 * grad_bytes <= held - dropped <= 1.02 * grad_bytes


def test_inside_the_runner_collections_scan_only_what_the_steps_made_and_leaving_restores_the_heap():
    """measure()'s collection before each empty_cache: the heap that existed on entry is collected once
    (its garbage cycles, which may pin device memory, freed) and frozen, so each collection inside scans
    only new objects, and a cycle made inside is still collected; leaving unfreezes the heap, and a heap
    the caller had frozen is left frozen."""
    import gc
    import weakref

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        a.tensor = torch.randn(16)
        return weakref.ref(a)

    assert gc.get_freeze_count() == 0
    before = cycle()  # garbage when the runner is entered
    assert before() is not None
    runner = runner_for(Tiny())
    with runner:
        assert before() is None  # collected on entry, not frozen with the rest
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the modules loaded so far
        inside = cycle()
        assert len(gc.get_objects()) < 10_000 <= frozen  # a collection's scan: the objects made inside only
        gc.collect()
        assert inside() is None
        runner.measure(lambda: torch.randn(4, 8), warmup=0, repeats=1)
    assert gc.get_freeze_count() == 0

    gc.freeze()
    try:
        with runner_for(Tiny()):
            pass
        assert gc.get_freeze_count() > 0  # the caller's freeze stands
    finally:
        gc.unfreeze()
