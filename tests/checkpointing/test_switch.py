import copy
import types

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_adaptiveload.checkpointing import (
    BATCH_KEY, BlockCheckpointing, check_composition, checkpointed_from_batch, find_blocks, resolve_block_classes,
    select_instances,
)
from lightning_adaptiveload.checkpointing.switch import ATTENTION_OPS
from tests.checkpointing.toy import ToyBlock, ToyNet, toy_batch

DEPTH = 4


def make_net(seed: int = 0) -> ToyNet:
    torch.manual_seed(seed)
    return ToyNet(depth=DEPTH).double()


def grads_of(net: nn.Module, seed: int = 1, rng_seed: int = 7) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, {name: grad}) of one forward + backward; dropout draws from a fixed RNG state."""
    x, context = toy_batch(seed)
    torch.manual_seed(rng_seed)
    loss = net(x, context).pow(2).mean()
    net.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters()}


def switched(net: ToyNet) -> BlockCheckpointing:
    return BlockCheckpointing(find_blocks(net, select_instances([ToyBlock])))


def test_wrapping_keeps_names_state_dict_and_classes_and_loads_both_ways():
    plain, wrapped = make_net(), make_net()
    switched(wrapped)
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert [type(m) for m in wrapped.modules()] == [type(m) for m in plain.modules()]
    other = make_net(seed=3)
    wrapped.load_state_dict(other.state_dict())  # plain checkpoint into the wrapped model
    plain.load_state_dict(wrapped.state_dict())  # and back
    for (name, a), b in zip(other.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("k", [0, 1, 3, DEPTH])
def test_gradients_equal_the_plain_and_a_statically_checkpointed_model(k):
    """fp64 on CPU: bitwise equal to no checkpointing and to torch's checkpoint_wrapper on the same blocks."""
    plain, dynamic, static = make_net(), make_net(), make_net()
    switch = switched(dynamic)
    switch.set_checkpointed(k)
    first_k = set(list(static.blocks)[:k])
    apply_activation_checkpointing(static, check_fn=lambda m: m in first_k)
    ref_loss, ref = grads_of(plain)
    for model in (dynamic, static):
        loss, got = grads_of(model)
        assert torch.equal(loss, ref_loss)
        # torch's wrapper renames parameters (ours does not): compare under the plain names
        got = {n.replace("._checkpoint_wrapped_module", ""): g for n, g in got.items()}
        assert got.keys() == ref.keys()
        for name, grad in ref.items():
            assert torch.equal(got[name], grad), name


@pytest.mark.parametrize("k", [0, 2, DEPTH])
def test_the_first_k_blocks_are_recomputed_and_the_last_keep_their_activations(k):
    net = make_net()
    switch = switched(net)
    switch.set_checkpointed(k)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    x, context = toy_batch(1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = net(x, context).pow(2).mean()
    loss.backward()
    assert [b.calls for b in net.blocks] == [2] * k + [1] * (DEPTH - k)  # recomputed in backward
    kept = sum(saved)
    # reference: a checkpointed block keeps only its tensor inputs (x, context), an un-checkpointed one what
    # a plain block of the same shapes saves for backward
    block_bytes = []
    ref_block = make_net().blocks[0]
    h = net.embed(x).detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: block_bytes.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        ref_block(h, context, gate=0.5)
    input_bytes = (h.numel() + context.numel()) * 8
    switch.set_checkpointed(DEPTH)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        net(x, context).pow(2).mean()
    assert kept == sum(saved) + (DEPTH - k) * (sum(block_bytes) - input_bytes)


class HeadsBlock(nn.Module):
    """Multi-head self-attention on (B, heads, N, d), which torch runs with a fused kernel on CPU too (the
    toy's 3-D attention runs the decomposed math path, which no selective policy can keep)."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        return x + self.proj(attended).tanh()


class CountAttention(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in ATTENTION_OPS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("save_attention", [True, False])
@pytest.mark.parametrize("k", [0, 2, DEPTH])
def test_a_checkpointed_block_keeps_its_attention_and_recomputes_the_rest(save_attention, k):
    """The fused attention kernel runs once per block and step when its output is kept, once more per
    checkpointed block when not; either way the rest of a checkpointed block runs again, and the
    gradients are bitwise those of the plain model (fp64, random data)."""
    def net_and_grads(switch_k):
        torch.manual_seed(0)
        net = nn.Sequential(*(HeadsBlock() for _ in range(DEPTH))).double()
        if switch_k is not None:
            BlockCheckpointing(list(net), save_attention=save_attention).set_checkpointed(switch_k)
        x = torch.randn(3, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        with CountAttention() as counted:
            net(x).pow(2).mean().backward()
        return net, counted.calls, {n: p.grad for n, p in net.named_parameters()}

    _, _, ref = net_and_grads(None)
    net, attention_calls, got = net_and_grads(k)
    assert [b.calls for b in net] == [2] * k + [1] * (DEPTH - k)
    assert attention_calls == DEPTH + (0 if save_attention else k)
    assert got.keys() == ref.keys() and all(torch.equal(got[n], g) for n, g in ref.items())


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"])
def test_on_the_gpu_each_sdpa_kernel_is_kept_not_recomputed(backend):
    """bf16 on CUDA, each fused SDPA kernel: a checkpointed block keeps its attention (the kernel runs once
    per block and step), and the gradients equal the plain model's (same kernels on the same inputs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def net_and_grads(k):
        torch.manual_seed(0)
        net = nn.Sequential(*(HeadsBlock(dim=256, heads=4) for _ in range(DEPTH))).cuda().bfloat16()
        if k is not None:
            BlockCheckpointing(list(net)).set_checkpointed(k)
        x = torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator("cuda").manual_seed(1))
        with sdpa_kernel(getattr(SDPBackend, backend)), CountAttention() as counted:
            net(x).float().pow(2).mean().backward()
        return counted.calls, {n: p.grad.float() for n, p in net.named_parameters()}

    _, ref = net_and_grads(None)
    calls, got = net_and_grads(DEPTH)
    assert calls == DEPTH
    for name, grad in ref.items():
        assert torch.allclose(got[name], grad, rtol=1e-2, atol=1e-3 * grad.abs().max().item()), name


def test_no_checkpointing_without_autograd():
    net = make_net()
    switched(net)
    with torch.no_grad():
        net(*toy_batch(1))
    net.eval()
    with torch.inference_mode():
        net(*toy_batch(1))
    assert [b.calls for b in net.blocks] == [2] * DEPTH


def test_switch_per_step_and_context_manager():
    net = make_net()
    switch = switched(net)
    assert switch.checkpointed == DEPTH and switch.num_blocks == DEPTH
    for step, k in enumerate([1, DEPTH, 0, 3]):
        for block in net.blocks:
            block.calls = 0
        switch.set_checkpointed(k)
        net(*toy_batch(step)).sum().backward()
        assert [b.calls for b in net.blocks] == [2] * k + [1] * (DEPTH - k)
    with switch.checkpointing(0):
        assert switch.checkpointed == 0
    assert switch.checkpointed == 3
    for bad in (-1, DEPTH + 1, 2.0, True, "2"):
        with pytest.raises(ValueError, match="checkpointed blocks"):
            switch.set_checkpointed(bad)


def test_wrapping_is_idempotent_keeps_an_earlier_instance_patch_and_unwraps():
    net = make_net()
    block = net.blocks[0]
    original = block.forward

    def patched(self, x, context, *, gate=1.0):  # e.g. a module surgery's fused forward
        self.patched_calls = getattr(self, "patched_calls", 0) + 1
        return type(self).forward(self, x, context, gate=gate)

    block.forward = types.MethodType(patched, block)
    first = switched(net)
    second = switched(net)  # takes the wrapped blocks over, no second layer
    second.set_checkpointed(1)
    net(*toy_batch(0)).sum().backward()
    assert block.patched_calls == 2 and block.calls == 2  # patched forward, recomputed once
    assert net.blocks[1].calls == 1
    first.unwrap()
    assert block.forward.__func__ is patched
    assert "forward" not in net.blocks[1].__dict__ and net.blocks[1].forward.__func__ is original.__func__


def test_deepcopy_rebinds_to_the_copy():
    net = make_net()
    switched(net).set_checkpointed(2)
    clone = copy.deepcopy(net)
    loss, ref = grads_of(make_net())
    loss_clone, got = grads_of(clone)
    assert torch.equal(loss, loss_clone)
    assert all(torch.equal(got[n], g) for n, g in ref.items())
    assert [b.calls for b in clone.blocks] == [2, 2, 1, 1]
    assert [b.calls for b in net.blocks] == [0] * DEPTH


def test_compiled_blocks_switch_and_match_eager():
    """torch.compile traces the switch and recompiles per setting. aot_eager (no C++ build on CPU) replays dropout's
    RNG in the recomputation like inductor does; the plain "eager" backend does not (a torch limitation)."""
    ref_loss, ref = grads_of(make_net())
    net = make_net()
    switch = switched(net)
    for block in net.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    for k in (DEPTH, 1, 0):
        switch.set_checkpointed(k)
        loss, got = grads_of(net)
        assert torch.equal(loss, ref_loss)
        assert all(torch.allclose(got[n], g, rtol=1e-12, atol=0) for n, g in ref.items()), k


def test_find_blocks_outermost_in_registration_order_once():
    shared = ToyBlock(8)
    outer = ToyBlock(8)
    outer.inner = ToyBlock(8)  # nested block: not selected separately
    root = nn.Sequential(nn.Linear(8, 8), outer, nn.ModuleList([shared, nn.ReLU(), shared]), ToyBlock(8))
    found = find_blocks(root, select_instances([ToyBlock]))
    assert found == [outer, shared, root[3]]


def test_resolve_block_classes():
    assert resolve_block_classes(ToyBlock) == (ToyBlock,)
    assert resolve_block_classes("tests.checkpointing.toy.ToyBlock") == (ToyBlock,)
    assert resolve_block_classes(["torch.nn.Linear", ToyBlock]) == (nn.Linear, ToyBlock)
    for bad, message in (("tests.checkpointing.toy.Nope", "cannot be imported"), ("no_such_module.Block", "cannot"),
                         ("ToyBlock", "no module part"), (int, "not a torch.nn.Module"), ([], "empty")):
        with pytest.raises(ValueError, match=message):
            resolve_block_classes(bad)


def test_depth_from_batch():
    assert checkpointed_from_batch({"x": 1}, 6) == 6
    assert checkpointed_from_batch([1, 2], 6) == 6
    assert checkpointed_from_batch({BATCH_KEY: 2}, 6) == 2
    assert checkpointed_from_batch({BATCH_KEY: torch.tensor(3)}, 6) == 3
    assert checkpointed_from_batch({BATCH_KEY: torch.tensor([0])}, 6) == 0
    assert checkpointed_from_batch({BATCH_KEY: np.int64(6)}, 6) == 6
    assert checkpointed_from_batch({"k": np.array([4])}, 6, key="k") == 4
    for bad in (7, -1, 2.5, torch.tensor(2.0), torch.tensor([1, 2]), True, None):
        with pytest.raises(ValueError, match="ac_blocks"):
            checkpointed_from_batch({BATCH_KEY: bad}, 6)


def test_check_composition_refuses_replaced_forwards_and_double_checkpointing():
    net = make_net()
    switch = switched(net)
    check_composition(net, switch)
    net.blocks[2].forward = types.MethodType(lambda self, *a, **k: ToyBlock.forward(self, *a, **k), net.blocks[2])
    with pytest.raises(ValueError, match="block 2 .*replaced"):
        check_composition(net, switch)

    net = make_net()
    switch = switched(net)
    apply_activation_checkpointing(net, check_fn=lambda m: isinstance(m, ToyBlock))
    with pytest.raises(ValueError, match="CheckpointWrapper wraps a switchable block"):
        check_composition(net, switch)

    net = make_net()
    apply_activation_checkpointing(net.blocks[0], check_fn=lambda m: m is net.blocks[0].ffn)
    switch = switched(net)
    with pytest.raises(ValueError, match="block 0 .*CheckpointWrapper"):
        check_composition(net, switch)


def test_empty_or_repeated_blocks_are_rejected():
    with pytest.raises(ValueError, match="at least one"):
        BlockCheckpointing([])
    block = ToyBlock(4)
    with pytest.raises(ValueError, match="twice"):
        BlockCheckpointing([block, block])
