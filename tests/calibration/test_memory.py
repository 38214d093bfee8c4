"""optimizer_state_present: verification's steps hold the optimizer state training will hold, and the
optimizer and parameters are exactly as before afterwards (the next real step is bit-identical to a
twin's that never went through it)."""
import copy
import gc
import weakref

import pytest
import torch

from lightning_adaptiveload.calibration.memory import optimizer_state_present


class Shifting(torch.optim.Optimizer):
    """An optimizer the state rule does not know, whose step moves the parameters even at lr 0."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["count"] = self.state[p].get("count", torch.zeros(())) + 1
                p.add_(1.0)  # not scaled by lr


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adam_l2": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1),  # L2 decay enters the moments at lr 0
    "adam_tensor_lr": lambda p: torch.optim.Adam(p, lr=torch.tensor(1e-2)),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, weight_decay=0.01),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5, centered=True),
    "unknown": lambda p: Shifting(p),
}


def real_step(net, optimizer, x):
    optimizer.zero_grad(set_to_none=True)
    net(x).square().sum().backward()
    optimizer.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_is_there_inside_and_the_next_real_step_is_bit_identical_to_a_twins(name):
    net, twin = model(), model()
    optimizer, twin_optimizer = OPTIMIZERS[name](net.parameters()), OPTIMIZERS[name](twin.parameters())
    before = copy.deepcopy(optimizer.state_dict())
    lrs = [g["lr"] for g in optimizer.param_groups]
    with optimizer_state_present([optimizer], torch.device("cpu")) as state:
        params = list(net.parameters())
        assert state.created and all(len(optimizer.state[p]) for p in params)
        expected = sum(v.numel() * v.element_size() for p in params for v in optimizer.state[p].values()
                       if torch.is_tensor(v))
        assert state.state_bytes == expected and state.step_peak_bytes is None
        assert all(p.grad is None for p in params)
    assert len(optimizer.state) == 0 and optimizer.state_dict() == before
    assert [g["lr"] for g in optimizer.param_groups] == lrs and all(p.grad is None for p in net.parameters())
    for p, q in zip(net.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    x = torch.randn(4, 7, dtype=torch.float64)
    for _ in range(2):
        real_step(net, optimizer, x)
        real_step(twin, twin_optimizer, x)
    for p, q in zip(net.parameters(), twin.parameters()):
        assert torch.equal(p, q), name


def test_state_that_is_there_already_is_left_alone_and_gradients_are_kept():
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    real_step(net, optimizer, torch.randn(3, 7, dtype=torch.float64))
    kept = {id(p): p.grad.clone() for p in net.parameters()}
    state = copy.deepcopy(optimizer.state_dict())
    with optimizer_state_present([optimizer], torch.device("cpu")) as made:
        assert not made.created and made.state_bytes == 0
    assert all(torch.equal(p.grad, kept[id(p)]) for p in net.parameters())
    after = optimizer.state_dict()
    for key, value in state["state"].items():
        for name, tensor in value.items():
            assert torch.equal(torch.as_tensor(after["state"][key][name]), torch.as_tensor(tensor))


@pytest.mark.parametrize("name", ["adamw", "unknown"])
def test_the_gradients_held_on_entry_are_freed_when_a_step_inside_replaces_them(name):
    """Verification enters with calibration's last gradients held and its steps replace them (set to
    None before backward, then new ones): nothing of the context may keep the old ones alive, or every
    verified peak holds one gradient copy that training does not."""
    net = model()
    optimizer = OPTIMIZERS[name](net.parameters())
    net(torch.randn(3, 7, dtype=torch.float64)).square().sum().backward()
    entry = [weakref.ref(p.grad) for p in net.parameters()]
    with optimizer_state_present([optimizer], torch.device("cpu")):
        assert all(ref() is p.grad for ref, p in zip(entry, net.parameters()))  # restored, not copies
        for p in net.parameters():
            p.grad = None  # what a verified step does before its backward
        gc.collect()
        assert all(ref() is None for ref in entry)


@pytest.mark.cuda
def test_on_cuda_the_state_is_measured_by_the_allocator_and_the_step_peak_recorded():
    device = torch.device("cuda")
    net, twin = model().to(device), model().to(device)
    optimizer, twin_optimizer = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (net, twin))
    param_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    with optimizer_state_present([optimizer], device) as state:
        # AdamW's two moments per parameter on the device (its step counters stay on the CPU), each
        # allocation rounded up to the caching allocator's 512-byte blocks
        rounded = sum(2 * -(-p.numel() * p.element_size() // 512) * 512 for p in net.parameters())
        assert state.created and state.state_bytes == rounded
        # the step held parameters, zero gradients and the new state at once
        assert state.step_peak_bytes >= 2 * param_bytes + 2 * param_bytes
    assert len(optimizer.state) == 0
    x = torch.randn(4, 7, dtype=torch.float64, device=device)
    real_step(net, optimizer, x)
    real_step(twin, twin_optimizer, x)
    for p, q in zip(net.parameters(), twin.parameters()):
        assert torch.equal(p, q)


@pytest.mark.cuda
def test_on_cuda_inside_the_device_holds_the_state_and_no_copy_of_the_entry_gradients():
    """The allocator's view of the leak the CPU test above checks by reference: with the gradients
    dropped inside, the device holds what it held on entry, less those gradients, plus the state."""
    device = torch.device("cuda")
    net = model().to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net(torch.randn(4, 7, dtype=torch.float64, device=device)).square().sum().backward()
    rounded = lambda t: -(-t.numel() * t.element_size() // 512) * 512  # noqa: E731 - allocator blocks
    grad_bytes = sum(rounded(p.grad) for p in net.parameters())
    gc.collect()  # what earlier tests left in garbage cycles, freed before the entry is read
    torch.cuda.synchronize(device)
    entry = torch.cuda.memory_allocated(device)
    with optimizer_state_present([optimizer], device) as state:
        for p in net.parameters():
            p.grad = None
        gc.collect()
        torch.cuda.synchronize(device)
        assert torch.cuda.memory_allocated(device) == entry - grad_bytes + state.state_bytes
