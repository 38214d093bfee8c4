"""LightningModule training the example VideoDiT with the flow-matching loss on the
AdaptiveLoadDataModule's batches (dict with `latents (B, C, T, H, W)` and `text (B, L, D_text)`)."""
from __future__ import annotations

import torch

from examples.video_dit.model import DiTConfig, VideoDiT, flow_matching_loss
from lightning_adaptiveload.clipping import FSDPNormClipping
from lightning_adaptiveload.loss import scale_loss_to_global_mean
from lightning_adaptiveload.regional_compile import COMPILE_MODES, compile_blocks


class VideoDiTModule(FSDPNormClipping):
    """Defaults are the Wan 2.1 1.3B shape; configs shrink it for the CPU demo.

    build_in_configure_model: build the network in `configure_model` instead of `__init__`
    (under FSDP Lightning then creates it inside the strategy's init context). Module surgery
    callbacks that run in `setup()` see no blocks in that case.
    compile: regional compilation of every transformer block in `configure_model` (after
    `FusedAdaLNSurgery`, which runs in `setup()`), by `regional_compile.compile_blocks`: "auto"
    (torch's default: static, then dynamic after the first recompile; measured in
    docs/lightning.md "Compiled training"), "dynamic" (dynamic from the first shape), "static" (a
    graph per shape), or None (eager).
    """

    def __init__(self, in_channels: int = 16, dim: int = 1536, num_layers: int = 30, num_heads: int = 12,
                 ffn_dim: int = 8960, text_dim: int = 4096, freq_dim: int = 256,
                 patch: tuple[int, int, int] = (1, 2, 2), activation_checkpointing: bool = False,
                 build_in_configure_model: bool = False, compile: str | None = None, lr: float = 1e-4,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999)):
        super().__init__()
        if compile is not None and compile not in COMPILE_MODES:
            raise ValueError(f"VideoDiTModule: compile must be one of {sorted(COMPILE_MODES)} or None, got {compile!r}")
        self.save_hyperparameters()
        self.config = DiTConfig(in_channels=in_channels, out_channels=in_channels, dim=dim, num_layers=num_layers,
                                num_heads=num_heads, ffn_dim=ffn_dim, text_dim=text_dim, freq_dim=freq_dim,
                                patch=tuple(patch), activation_checkpointing=activation_checkpointing)
        self.dit: VideoDiT | None = None if build_in_configure_model else VideoDiT(self.config)

    def configure_model(self) -> None:
        if self.dit is None:  # Lightning may call this hook more than once
            self.dit = VideoDiT(self.config)
        if self.hparams.compile is not None:
            compile_blocks(self.dit.blocks, self.hparams.compile)

    def training_step(self, batch: dict, batch_idx: int) -> dict[str, torch.Tensor]:
        """{"loss": the loss to backpropagate (rescaled, see below), "local_loss": this rank's
        unscaled mean loss over its batch, detached (what is logged; callbacks read it from
        `outputs`)}."""
        latents = batch["latents"].to(self.dit.patch_embedding.weight.dtype)
        text = batch["text"].to(latents.dtype)
        batch_size = latents.shape[0]
        t = torch.rand(batch_size, device=latents.device)
        noise = torch.randn_like(latents)
        loss = flow_matching_loss(self.dit, latents, text, t, noise)
        self.log("train/loss", loss.detach(), batch_size=batch_size, prog_bar=True)
        # Ranks hold different batch sizes under AdaptiveLoad; rescale so the gradient average
        # over ranks is the mean over all samples of the global batch.
        return {"loss": scale_loss_to_global_mean(loss, batch_size), "local_loss": loss.detach()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        return torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas))
