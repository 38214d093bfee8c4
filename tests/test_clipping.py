"""FSDPNormClipping: norm clipping goes to FSDP1's own clip_grad_norm_ (the norm over every shard), and
every other case to Lightning's default."""
import types

import lightning as L
import pytest
import torch

from lightning_adaptiveload.clipping import FSDPNormClipping


class _RecordingFSDP(torch.distributed.fsdp.FullyShardedDataParallel):
    """isinstance-FSDP1 stand-in (FSDPStrategy refuses the CPU) recording clip_grad_norm_ calls."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        self.clipped = []

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        self.clipped.append(max_norm)


@pytest.mark.parametrize("fsdp1, algorithm, routed_to_fsdp", [
    (True, "norm", True), (True, None, True), (True, "value", False), (False, "norm", False)])
def test_gradient_clipping_by_norm_under_fsdp1_goes_to_fsdp(monkeypatch, fsdp1, algorithm, routed_to_fsdp):
    """Lightning's FSDP precision plugin raises for norm clipping (Lightning #19235; hit by
    examples/configs/h200_fsdp.yaml on two H200s): FSDP's clip_grad_norm_ instead, every other case to
    Lightning."""
    module = FSDPNormClipping()
    wrapped = _RecordingFSDP() if fsdp1 else torch.nn.Module()
    module._trainer = types.SimpleNamespace(model=wrapped)
    lightning_calls = []
    monkeypatch.setattr(L.LightningModule, "configure_gradient_clipping",
                        lambda self, opt, val=None, alg=None: lightning_calls.append((val, alg)))
    module.configure_gradient_clipping(None, 0.7, algorithm)
    assert (wrapped.clipped if fsdp1 else []) == ([0.7] if routed_to_fsdp else [])
    assert lightning_calls == ([] if routed_to_fsdp else [(0.7, algorithm)])
