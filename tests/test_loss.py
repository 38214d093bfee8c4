"""scale_loss_to_global_mean: a 2-process gloo DDP run with unequal per-rank batches must give
the gradient of one process on the union batch (fp64), and the unscaled loss must not."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from lightning_adaptiveload.loss import scale_loss_to_global_mean

SAMPLE_SPLIT = (3, 7)  # samples on rank 0, rank 1
TOKEN_SPLIT = ((5, 9), (30,))  # tokens per sequence on rank 0, rank 1
DIM = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


def _sample_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = sum(SAMPLE_SPLIT)
    return torch.randn(n, DIM, generator=g, dtype=torch.float64), torch.randn(n, 1, generator=g, dtype=torch.float64)


def _token_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    n = sum(sum(lens) for lens in TOKEN_SPLIT)
    return torch.randn(n, DIM, generator=g, dtype=torch.float64), torch.randn(n, 1, generator=g, dtype=torch.float64)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _per_sample_loss(model, x, y) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean(dim=1)


def _ddp_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = DistributedDataParallel(_model())
        results = {}

        # Per-sample mean: rank r holds SAMPLE_SPLIT[r] samples.
        x, y = _sample_data()
        start = sum(SAMPLE_SPLIT[:rank])
        xl, yl = x[start:start + SAMPLE_SPLIT[rank]], y[start:start + SAMPLE_SPLIT[rank]]
        for name, scaled in (("sample_scaled", True), ("sample_unscaled", False)):
            model.zero_grad(set_to_none=True)
            loss = _per_sample_loss(model, xl, yl).mean()
            if scaled:
                loss = scale_loss_to_global_mean(loss, len(xl))
            loss.backward()
            results[name] = _grads(model.module)

        # Per-token mean: rank r holds sequences of TOKEN_SPLIT[r] tokens; count is a tensor.
        x, y = _token_data()
        start = sum(sum(lens) for lens in TOKEN_SPLIT[:rank])
        n_tok = sum(TOKEN_SPLIT[rank])
        model.zero_grad(set_to_none=True)
        loss = _per_sample_loss(model, x[start:start + n_tok], y[start:start + n_tok]).mean()
        scale_loss_to_global_mean(loss, torch.tensor(n_tok)).backward()
        results["token_scaled"] = _grads(model.module)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_grads(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("loss_ddp")
    mp.spawn(_ddp_worker, args=(2, str(out / "init"), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def _union_grads(x, y) -> list[torch.Tensor]:
    model = _model()
    _per_sample_loss(model, x, y).mean().backward()
    return _grads(model)


def test_scaled_ddp_gradient_equals_union_batch(ddp_grads):
    reference = _union_grads(*_sample_data())
    for rank_grads in ddp_grads:
        for got, want in zip(rank_grads["sample_scaled"], reference):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_scaled_ddp_per_token_gradient_equals_union_batch(ddp_grads):
    reference = _union_grads(*_token_data())
    for rank_grads in ddp_grads:
        for got, want in zip(rank_grads["token_scaled"], reference):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_unscaled_ddp_gradient_is_biased(ddp_grads):
    reference = _union_grads(*_sample_data())
    # What DDP computes without scaling: the plain mean of the two per-rank mean gradients.
    x, y = _sample_data()
    n0 = SAMPLE_SPLIT[0]
    per_rank = [_union_grads(x[:n0], y[:n0]), _union_grads(x[n0:], y[n0:])]
    for got, want, g0, g1 in zip(ddp_grads[0]["sample_unscaled"], reference, *per_rank):
        torch.testing.assert_close(got, (g0 + g1) / 2, rtol=1e-12, atol=1e-14)
    max_rel = max(float((g - w).norm() / w.norm()) for g, w in zip(ddp_grads[0]["sample_unscaled"], reference))
    assert max_rel > 1e-3


def test_without_process_group_is_identity():
    loss = torch.randn((), dtype=torch.float64, requires_grad=True)
    assert scale_loss_to_global_mean(loss, 5) is loss


@pytest.mark.parametrize("count, match", [(-1, "local_count must be >= 0"), (torch.ones(2), "single number")])
def test_bad_count_is_rejected(count, match):
    with pytest.raises(ValueError, match=match):
        scale_loss_to_global_mean(torch.randn(()), count)
