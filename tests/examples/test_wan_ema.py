"""examples/wan/ema.py through WanModule(ema_decay=...) on one CPU device: the EMA after real
training steps against the recursion computed by hand in fp64 from the weights after each step, its
resumption from a checkpoint, `ema_weights` swapping in and out, and the refusal under FSDP."""
import types

import lightning as L
import pytest
import torch

pytest.importorskip("diffusers")

from examples.wan.ema import EMA_KEY, ema_weights  # noqa: E402
from examples.wan.module import WanModule  # noqa: E402

TINY = dict(num_layers=1, num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32,
            freq_dim=32, ffn_dim=64)
DECAY = 0.8  # far from 1, so every step's weights show in the average

pytestmark = pytest.mark.usefixtures("one_thread")


class WeightsAfterEachStep(L.Callback):
    def __init__(self):
        self.weights = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.weights.append({n: p.detach().double().clone() for n, p in pl_module.named_parameters()})


def _fit(tmp_path, max_steps, ckpt_path=None):
    torch.manual_seed(0)
    module = WanModule(transformer_config=TINY, lr=1e-2, warmup_steps=2, ema_decay=DECAY)
    g = torch.Generator().manual_seed(1)
    batches = [{"latents": torch.randn(2, 4, 1, 4, 4, generator=g), "text": torch.randn(2, 5, 32, generator=g)}
               for _ in range(8)]
    recorder = WeightsAfterEachStep()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[recorder], default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
    return module, trainer, recorder.weights


def _by_hand(weights: list[dict]) -> dict:
    """ema_1 = w_1, ema_k = DECAY ema_(k-1) + (1 - DECAY) w_k (fp64)."""
    ema = dict(weights[0])
    for w in weights[1:]:
        ema = {n: DECAY * ema[n] + (1 - DECAY) * w[n] for n in ema}
    return ema


def _ema_of(module, trainer) -> dict:
    optimizer = trainer.optimizers[0]
    return {n: optimizer.state[p][EMA_KEY] for n, p in module.named_parameters()}


def test_ema_after_training_steps_is_the_recursion_by_hand_and_resumes_from_a_checkpoint(tmp_path):
    module, trainer, weights = _fit(tmp_path, max_steps=4)
    assert len(weights) == 4
    expected, got = _by_hand(weights), _ema_of(module, trainer)
    for name, value in expected.items():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name].double(), value, rtol=1e-6, atol=1e-7, msg=name)
    # the weights moved, so the EMA differs from the last weights: the test sees the average
    assert any(not torch.allclose(expected[n], weights[-1][n]) for n in expected)
    path = tmp_path / "four.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["optimizer_states"][0]["state"]
    assert all(EMA_KEY in entry for entry in state.values())
    # resumed: the average continues from the saved one
    resumed, trainer, more = _fit(tmp_path, max_steps=6, ckpt_path=str(path))
    assert len(more) == 2
    expected = _by_hand(weights + more)
    got = _ema_of(resumed, trainer)
    for name, value in expected.items():
        torch.testing.assert_close(got[name].double(), value, rtol=1e-6, atol=1e-7, msg=name)


def test_ema_weights_swaps_the_average_in_and_the_trained_weights_back(tmp_path):
    module, trainer, weights = _fit(tmp_path, max_steps=3)
    optimizer = trainer.optimizers[0]
    trained = {n: p.detach().clone() for n, p in module.named_parameters()}
    with ema_weights(optimizer):
        for name, p in module.named_parameters():
            assert torch.equal(p, optimizer.state[p][EMA_KEY]), name
    for name, p in module.named_parameters():
        assert torch.equal(p, trained[name]), name


def test_ema_is_off_by_default_and_refused_under_fsdp():
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    assert WanModule(transformer_config=TINY).hparams.ema_decay is None
    for strategy in (FSDPStrategy(), ModelParallelStrategy(1, 1)):
        module = WanModule(transformer_config=TINY, ema_decay=0.999)
        module._trainer = types.SimpleNamespace(strategy=strategy, precision="32-true")
        with pytest.raises(ValueError, match=f"ema_decay works on one device and under DDP, not under "
                                             f"{type(strategy).__name__}"):
            module.setup("fit")
