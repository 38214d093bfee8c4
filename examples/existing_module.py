"""Adding AdaptiveLoad to a LightningModule that was not written for it.

`ConvVideoDenoiser` stands for your existing module: its own network, its own batch format
(a `(video, text)` tuple) and its own loss. Adding the suite takes the lines in
`AdaptiveLoadDenoiser` (read the batch dict, rescale the loss for unequal per-rank batches) and
`fit` (the DataModule, the two callbacks, `use_distributed_sampler=False`).

Run: python -m examples.existing_module --shards runs/existing/shards --max-steps 20
"""
from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_adaptiveload.callbacks import CostModelCalibration, LoadBalanceMonitor
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loss import scale_loss_to_global_mean

DEMO_MIX = Path(__file__).parent / "configs" / "demo_mix.jsonl"


class ConvVideoDenoiser(L.LightningModule):
    """An ordinary video denoiser: predicts the noise added to a latent video, conditioned on the
    mean text embedding. Batches are `(video (B, C, T, H, W), text (B, L, D_text))` tuples."""

    def __init__(self, channels: int = 4, text_dim: int = 32, width: int = 32, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.inp = nn.Conv3d(channels, width, kernel_size=3, padding=1)
        self.cond = nn.Linear(text_dim + 1, width)
        self.out = nn.Conv3d(width, channels, kernel_size=3, padding=1)

    def forward(self, noisy: torch.Tensor, sigma: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        cond = self.cond(torch.cat([text.mean(dim=1), sigma[:, None]], dim=1))  # (B, width)
        return self.out(F.silu(self.inp(noisy) + cond[:, :, None, None, None]))

    def training_step(self, batch, batch_idx):
        video, text = batch
        sigma = torch.rand(video.shape[0], device=video.device)
        noise = torch.randn_like(video)
        loss = F.mse_loss(self(video + sigma.view(-1, 1, 1, 1, 1) * noise, sigma, text), noise)
        self.log("loss", loss, batch_size=video.shape[0])
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class AdaptiveLoadDenoiser(ConvVideoDenoiser):
    """The same module fed by AdaptiveLoadDataModule: two changed lines in training_step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step((batch["latents"], batch["text"]), batch_idx)
        return scale_loss_to_global_mean(loss, batch["latents"].shape[0])  # ranks hold unequal batches


def fit(shards: str, index: str, max_steps: int = 20, root_dir: str = "runs/existing",
        calibration: dict | None = None, **trainer_kwargs) -> L.Trainer:
    """Train AdaptiveLoadDenoiser on synthetic demo shards (written on first use); `calibration`:
    extra CostModelCalibration arguments."""
    datamodule = AdaptiveLoadDataModule(shards=shards, index=index, policy="balanced", m_mem=640,
                                        latent_channels=4, text_len=8, text_dim=32, num_workers=0,
                                        synthesize=200, synthesize_shapes=str(DEMO_MIX))
    trainer = L.Trainer(
        max_steps=max_steps, default_root_dir=root_dir, use_distributed_sampler=False,
        callbacks=[CostModelCalibration(num_seq_lens=3, batch_sizes=[1, 2, 4, 8], **(calibration or {})),
                   LoadBalanceMonitor()],
        **trainer_kwargs)
    trainer.fit(AdaptiveLoadDenoiser(), datamodule=datamodule)
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="runs/existing/shards")
    parser.add_argument("--index", default="runs/existing/index.jsonl")
    parser.add_argument("--max-steps", type=int, default=20)
    args = parser.parse_args()
    fit(args.shards, args.index, args.max_steps)
