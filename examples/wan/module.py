"""LightningModule training diffusers' Wan 2.1 transformer (`WanTransformer3DModel`) with Wan's
flow-matching objective on the AdaptiveLoadDataModule's batches, under one device, DDP, FSDP1
(`FSDPStrategy`) or FSDP2 (`ModelParallelStrategy`).

Objective (rectified flow, as Wan 2.1 and diffusers' flow-match schedulers define it): for a clean
latent x0 (B, C, T, H, W), noise n ~ N(0, 1) of the same shape and a noise level sigma in [0, 1]
per sample, x_t = (1 - sigma) x0 + sigma n; the transformer gets x_t, timestep = 1000 sigma (a
float in [0, 1000], the scale of Wan's 1000 training timesteps) and the text embeddings, and
predicts the velocity v = n - x0; the loss is the mean squared error, in fp32. Noise levels, the
timestep shift (fixed 3 by default), caption dropout and the loss weighting: objective.py. What
runs in fp32 under each strategy: precision.py. `pretrained` loading without a random init:
loading.py. The optional EMA of the weights: ema.py. The recipe, and why: docs/lightning.md,
"Training Wan 2.1".
"""
from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from examples.wan import ema, loading, objective, precision
from examples.wan.objective import LOSS_WEIGHTINGS, SHIFT_RULES, TIMESTEP_SAMPLINGS
from lightning_adaptiveload.clipping import FSDPNormClipping
from lightning_adaptiveload._validation import require_int, require_number
from lightning_adaptiveload.loss import scale_loss_to_global_mean
from lightning_adaptiveload.regional_compile import COMPILE_MODES, compile_blocks

# diffusers' WanTransformer3DModel arguments of Wan 2.1 T2V 1.3B (the published
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json); the class's own defaults are the 14B.
WAN21_T2V_1_3B: dict[str, Any] = {
    "patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
    "added_kv_proj_dim": None, "rope_max_seq_len": 1024, "pos_embed_seq_len": None,
}
NUM_TRAIN_TIMESTEPS = 1000  # the model's timestep input is sigma * 1000
FSDP2_PARAM_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _check_transformer_config(overrides: dict[str, Any]) -> None:
    from diffusers import WanTransformer3DModel

    known = set(inspect.signature(WanTransformer3DModel.__init__).parameters) - {"self"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"WanModule: transformer_config has keys WanTransformer3DModel does not take: {unknown} "
                         f"(known: {sorted(known)})")


class WanModule(FSDPNormClipping):
    """diffusers `WanTransformer3DModel` trained with Wan's flow-matching loss (module docstring).

    transformer_config: WanTransformer3DModel arguments overriding `WAN21_T2V_1_3B` key by key (a
        tiny model for the CPU: fewer layers and heads, small dims). Not allowed with `pretrained`.
    pretrained: a local diffusers folder (loading.py). The transformer is built empty (meta device,
        no init) where it is built, and its weights are read in `configure_model`: whole, or under
        FSDP2 each rank only its shards. Outside a Trainer, call `configure_model()` before use.
        None: diffusers' random init.
    build_in_configure_model: build the transformer in `configure_model` instead of `__init__`.
        Callbacks acting in `setup()` (FusedAdaLNSurgery, PerBucketCheckpointing's early wrap) see
        no blocks then; keep it False with them.
    compile: regional compilation of every `WanTransformerBlock` in `configure_model`: "auto"
        (torch's default, static then dynamic after the first recompile; docs/lightning.md "Compiled
        training"), "dynamic", "static" or None (eager).
    timestep_sampling, logit_mean, logit_std: u ~ U(0, 1) ("uniform") or sigmoid(N(mean, std))
        ("logit_normal"), before the shift (objective.py).
    shift_rule, shift, shift_reference_area, shift_min: the timestep shift (objective.py): "fixed",
        s = `shift` (default 3.0); "sqrt_area", s = max(shift_min, shift * sqrt(A / shift_reference_area))
        with A the transformer tokens of one latent frame (default reference 1,560: a 480x832 frame).
    caption_dropout: probability that a sample trains on the empty prompt instead of its caption (a
        model that never sees it cannot use classifier-free guidance); decided per sample on each
        rank from the global RNG after sigma and the noise, so reproducible under the seed.
    empty_prompt: the empty prompt's embedding to drop to (a file, or a folder holding
        `empty_prompt.text.npy`); None: the one `adaptiveload encode` writes beside the DataModule's
        shards, else an all-zero context, with one warning.
    loss_weighting, loss_reference_tokens: "sample" (each step the mean over the global batch's
        samples) or "token" (every token weighs 1 / (world_size * loss_reference_tokens) in every
        step), objective.weighted_step_loss; "token" needs loss_reference_tokens (e.g. data.m_mem).
    fsdp2_param_dtype: under ModelParallelStrategy, the dtype FSDP2 gathers the blocks' and
        embeddings' parameters in for compute ("bfloat16", or "float32" for exact fp32 training);
        the modules diffusers keeps in fp32 outside the blocks gather in fp32 (precision.py),
        gradients are reduced in fp32 and the sharded master weights and AdamW state stay fp32 (use
        precision "32-true" there).
    lr, warmup_steps, weight_decay, betas: AdamW at `lr` (1e-5: full fine-tuning of Wan 2.1; 1e-4 is
        a LoRA rate), reached linearly over the first `warmup_steps` optimizer steps (0: none).
    ema_decay: keep an EMA of the weights with this decay (e.g. 0.999; ema.py); None: none. One
        device and DDP only.
    """

    def __init__(self, transformer_config: dict[str, Any] | None = None, pretrained: str | None = None,
                 build_in_configure_model: bool = False, compile: str | None = None,
                 timestep_sampling: str = "uniform", logit_mean: float = 0.0, logit_std: float = 1.0,
                 shift_rule: str = "fixed", shift: float = 3.0, shift_reference_area: int = 1560,
                 shift_min: float = 1.0, caption_dropout: float = 0.0, empty_prompt: str | None = None,
                 loss_weighting: str = "sample", loss_reference_tokens: int | None = None,
                 fsdp2_param_dtype: str = "bfloat16", lr: float = 1e-5, warmup_steps: int = 100,
                 weight_decay: float = 0.01, betas: tuple[float, float] = (0.9, 0.999),
                 ema_decay: float | None = None):
        super().__init__()
        overrides = dict(transformer_config or {})
        if pretrained is not None and overrides:
            raise ValueError("WanModule: give pretrained (its config.json sets the shape) or transformer_config, "
                             f"not both (transformer_config={overrides})")
        _check_transformer_config(overrides)
        for name, value, options in (("compile", compile, COMPILE_MODES), ("timestep_sampling", timestep_sampling,
                                     TIMESTEP_SAMPLINGS), ("shift_rule", shift_rule, SHIFT_RULES),
                                     ("loss_weighting", loss_weighting, LOSS_WEIGHTINGS),
                                     ("fsdp2_param_dtype", fsdp2_param_dtype, FSDP2_PARAM_DTYPES)):
            if value not in options and not (name == "compile" and value is None):
                raise ValueError(f"WanModule: {name} must be one of {sorted(options)}"
                                 f"{' or None' if name == 'compile' else ''}, got {value!r}")
        require_number("WanModule: shift", shift, positive=True)
        require_number("WanModule: shift_min", shift_min, positive=True)
        require_number("WanModule: logit_mean", logit_mean)
        require_number("WanModule: logit_std", logit_std, positive=True)
        require_int("WanModule: shift_reference_area (tokens per latent frame)", shift_reference_area)
        if not (require_number("WanModule: caption_dropout", caption_dropout, minimum=0.0) < 1):
            raise ValueError(f"WanModule: caption_dropout must be a probability in [0, 1), got {caption_dropout}")
        if loss_weighting == "token" or loss_reference_tokens is not None:
            require_int("WanModule: loss_reference_tokens (tokens per rank and step; loss_weighting: token "
                        "needs it)", loss_reference_tokens)
        require_number("WanModule: lr", lr, positive=True)
        require_int("WanModule: warmup_steps", warmup_steps, minimum=0)
        if ema_decay is not None and not 0 < require_number("WanModule: ema_decay", ema_decay, positive=True) < 1:
            raise ValueError(f"WanModule: ema_decay must be in (0, 1) or None, got {ema_decay}")
        self.save_hyperparameters()
        config = {**WAN21_T2V_1_3B, **overrides}
        config["patch_size"] = tuple(config["patch_size"])  # YAML gives a list
        self.transformer_kwargs = config  # what a random init builds (a pretrained folder has its own config)
        self._weights: loading.SafetensorsWeights | None = None  # set while pretrained weights are still to read
        self.transformer = None if build_in_configure_model else self._build_transformer()
        self._fsdp2_dtype: torch.dtype | None = None  # set once configure_model applied fully_shard
        self._empty_text: torch.Tensor | None = None  # (L, D) the empty prompt's embedding, once looked up
        self._empty_text_resolved = False
        self._empty_source = ""  # where _empty_text came from, for messages

    def _build_transformer(self):
        from diffusers import WanTransformer3DModel

        if self.hparams.pretrained is not None:
            folder = loading.transformer_folder(self.hparams.pretrained)
            self._weights = loading.SafetensorsWeights(folder, self.hparams.pretrained)
            model = loading.build_empty(loading.read_config(folder))
            self._weights.check_against(model)  # a wrong folder fails here, before any training setup
        else:
            model = WanTransformer3DModel(**self.transformer_kwargs)
        config = model.config
        # the target velocity has the input's channels; image-to-video Wan (in 36, out 16) also takes
        # conditioning channels, which this text-to-video objective does not build
        if config["out_channels"] != config["in_channels"] or config["image_dim"] is not None:
            raise ValueError(f"WanModule trains text-to-video Wan: in_channels == out_channels and no image_dim, got "
                             f"in_channels={config['in_channels']}, out_channels={config['out_channels']}, "
                             f"image_dim={config['image_dim']}")
        precision.keep_time_embedder_fp32(model)
        return model

    # -- parallelism and precision --

    def setup(self, stage: str) -> None:
        """Before `configure_model` and before the strategy wraps the model: refuse the EMA under
        sharding (ema.py), give FSDP1 under bf16-mixed its Wan mixed precision unless the strategy
        has one (precision.py), and look up the empty prompt for caption dropout."""
        strategy = self.trainer.strategy
        if self.hparams.ema_decay is not None and isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
            raise ValueError(f"WanModule: ema_decay works on one device and under DDP, not under "
                             f"{type(strategy).__name__}: a sharded checkpoint would not resume the average. "
                             "Set model.ema_decay to null or use DDP.")
        if isinstance(strategy, FSDPStrategy) and strategy.mixed_precision is None \
                and self.trainer.precision == "bf16-mixed":
            strategy.mixed_precision = precision.fsdp1_mixed_precision()
        if self.hparams.caption_dropout > 0:
            self._resolve_empty_prompt()

    def configure_model(self) -> None:
        """Build the transformer if deferred, read pretrained weights still to read, compile its
        blocks (`compile`), and under ModelParallelStrategy shard it with FSDP2, in torchtitan's
        order: checkpointing (done by PerBucketCheckpointing in `setup()`, before this hook),
        per-block compile, `fully_shard` (precision.shard_with_fp32_groups). Pretrained weights
        under FSDP2 are read after sharding, each rank its own rows (loading.py); otherwise before.
        Under FSDPStrategy (FSDP1) the strategy wraps the model after this hook (`auto_wrap_policy:
        [WanTransformerBlock]`). Lightning may call it more than once: nothing is built, read,
        compiled or sharded twice."""
        if self.transformer is None:
            self.transformer = self._build_transformer()
        fsdp2 = self._trainer is not None and isinstance(self.trainer.strategy, ModelParallelStrategy)
        if self._weights is not None and not fsdp2:
            loading.load_full(self.transformer, self._weights)
            self._weights = None
        if self.hparams.compile is not None:
            compile_blocks(self.transformer.blocks, self.hparams.compile)
        if fsdp2 and self._fsdp2_dtype is None:
            self._fully_shard()
        if self._weights is not None:
            # before Lightning would materialise the meta parameters with a random init
            self.transformer.to_empty(device=self.trainer.strategy.root_device)
            loading.load_local_shards(self.transformer, self._weights)
            self._weights = None

    def _fully_shard(self) -> None:
        mesh = self.device_mesh
        if mesh["tensor_parallel"].size() != 1:
            raise ValueError(f"WanModule shards with FSDP2 only: use ModelParallelStrategy(data_parallel_size=N, "
                             f"tensor_parallel_size=1), got a tensor-parallel size of {mesh['tensor_parallel'].size()}")
        dtype = FSDP2_PARAM_DTYPES[self.hparams.fsdp2_param_dtype]
        precision.shard_with_fp32_groups(self.transformer, mesh["data_parallel"], dtype)
        self._fsdp2_dtype = dtype

    def input_dtype(self) -> torch.dtype:
        """The dtype latents and text enter the transformer in: FSDP2's compute dtype once sharded
        (it gathers parameters in that dtype and, with cast_forward_inputs off, casts no input),
        else the patch embedding's (fp32 params: autocast, if any, casts inside)."""
        return self._fsdp2_dtype or self.transformer.patch_embedding.weight.dtype

    # -- objective --

    def shift_for(self, frame_tokens: int) -> float:
        """The timestep shift s for samples whose latent frames have `frame_tokens` transformer
        tokens each (objective.py)."""
        hp = self.hparams
        if hp.shift_rule == "fixed":
            return float(hp.shift)
        return objective.area_shift(frame_tokens, hp.shift, hp.shift_reference_area, hp.shift_min)

    def sample_sigmas(self, batch_size: int, frame_tokens: int, device: torch.device | str) -> torch.Tensor:
        """(batch_size,) fp32 noise levels in [0, 1]: u from `timestep_sampling` (global RNG), then
        shifted with `shift_for(frame_tokens)`."""
        hp = self.hparams
        return objective.sample_noise_levels(batch_size, self.shift_for(frame_tokens), hp.timestep_sampling,
                                             hp.logit_mean, hp.logit_std, device)

    def token_grid(self, latents: torch.Tensor) -> tuple[int, int, int]:
        """The transformer's token grid (T/pt, H/ph, W/pw) of latents (B, C, T, H, W). Raises a
        ValueError naming the problem for latents the transformer cannot take."""
        config = self.transformer.config  # the built model's (pretrained: its config.json)
        channels, patch = config["in_channels"], tuple(config["patch_size"])
        if latents.ndim != 5 or latents.shape[1] != channels:
            raise ValueError(f"WanModule: batch['latents'] must be (B, {channels}, T, H, W), "
                             f"got {tuple(latents.shape)}")
        thw = tuple(latents.shape[2:])
        if any(size % p for size, p in zip(thw, patch)):
            raise ValueError(f"WanModule: latent (T, H, W) = {thw} is not a multiple of patch_size {patch}")
        grid = tuple(size // p for size, p in zip(thw, patch))
        if max(grid) > config["rope_max_seq_len"]:
            raise ValueError(f"WanModule: latent grid {grid} (after patching) exceeds rope_max_seq_len "
                             f"{config['rope_max_seq_len']} on some axis")
        return grid

    def tokens_of(self, latents: torch.Tensor) -> int:
        """Transformer tokens per sample of latents (B, C, T, H, W): T/pt * H/ph * W/pw."""
        return math.prod(self.token_grid(latents))

    def per_sample_loss(self, latents: torch.Tensor, text: torch.Tensor, sigma: torch.Tensor,
                        noise: torch.Tensor) -> torch.Tensor:
        """(B,) fp32: each sample's mean over its latent elements of (pred - (noise - x0))^2,
        pred = transformer(x_t, 1000 sigma, text), x_t = (1 - sigma) x0 + sigma noise.
        latents x0, noise (B, C, T, H, W); text (B, L, text_dim); sigma (B,) in [0, 1]. x_t and the
        target are formed in fp32 (the batch may arrive in bf16 under FSDP1's mixed precision), the
        timestep stays fp32; x_t and text enter the transformer in `input_dtype()`."""
        x0 = latents.float()
        s = sigma.float().view(-1, 1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * noise.float()
        dtype = self.input_dtype()
        pred = self.transformer(hidden_states=x_t.to(dtype), timestep=sigma.float() * NUM_TRAIN_TIMESTEPS,
                                encoder_hidden_states=text.to(dtype), return_dict=False)[0]
        return (pred.float() - (noise.float() - x0)).pow(2).flatten(1).mean(1)

    def flow_matching_loss(self, latents: torch.Tensor, text: torch.Tensor, sigma: torch.Tensor,
                           noise: torch.Tensor) -> torch.Tensor:
        """Scalar fp32: the mean of `per_sample_loss` over the batch (every sample of a batch has
        the same shape, so also the mean over every latent element)."""
        return self.per_sample_loss(latents, text, sigma, noise).mean()

    def _resolve_empty_prompt(self) -> None:
        """Look the empty prompt's embedding up once (class docstring, `empty_prompt`)."""
        if self._empty_text_resolved:
            return
        from lightning_adaptiveload.data.shards import EMPTY_PROMPT_FILE, read_empty_prompt, resolve_shards

        self._empty_text_resolved = True
        if self.hparams.empty_prompt is not None:
            path = Path(self.hparams.empty_prompt)
            self._empty_text = torch.from_numpy(read_empty_prompt(path)).float()
            self._empty_source = str(path / EMPTY_PROMPT_FILE if path.is_dir() else path)
            return
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        shards = getattr(datamodule, "shards", None)
        if shards is None:
            objective.warn_zero_context("no DataModule with shards, and model.empty_prompt is not set")
            return
        folders = [Path(path).parent for path in resolve_shards(shards)]
        found = objective.find_empty_prompt(folders)
        if found is None:
            objective.warn_zero_context(f"none beside the shards in {sorted({str(f) for f in folders})[:3]}")
            return
        self._empty_text, path = found
        self._empty_source = str(path)

    def drop_captions(self, text: torch.Tensor) -> torch.Tensor:
        """text (B, L, D) with each sample's caption replaced, with probability `caption_dropout`,
        by the empty prompt's embedding (zero-padded to L; all zeros without one). Draws (B,)
        uniforms from the global RNG."""
        self._resolve_empty_prompt()
        drop = torch.rand(text.shape[0], device=text.device) < self.hparams.caption_dropout
        empty = self._empty_text
        if empty is None:
            return torch.where(drop.view(-1, 1, 1), torch.zeros((), dtype=text.dtype, device=text.device), text)
        if empty.shape[1] != text.shape[2]:
            raise ValueError(f"WanModule: the empty prompt's embedding {self._empty_source} is {tuple(empty.shape)}, "
                             f"but the captions have {text.shape[2]} channels: encode it with the captions' "
                             "text encoder")
        return objective.drop_captions(text, drop, empty)

    def training_step(self, batch: dict, batch_idx: int) -> dict[str, torch.Tensor]:
        """One step on the DataModule's batch dict (`latents` (B, C, T, H, W), `text` (B, L, D_text);
        the other keys are not read). Draws sigma, then the noise, then (caption_dropout > 0) the
        samples whose caption is dropped, from the global RNG. Returns {"loss": the loss to
        backpropagate, by `loss_weighting` (objective.weighted_step_loss; "sample" rescaled by
        `scale_loss_to_global_mean` so that the gradient average over ranks with unequal batch sizes
        is the mean over every sample of the global batch); "local_loss": this rank's per-sample
        mean loss, detached (what is logged, and what callbacks recording the loss read)}."""
        latents, text = batch["latents"], batch["text"]
        grid = self.token_grid(latents)
        batch_size = latents.shape[0]
        text_dim = self.transformer.config["text_dim"]
        if text.ndim != 3 or text.shape[0] != batch_size or text.shape[2] != text_dim:
            raise ValueError(f"WanModule: batch['text'] must be ({batch_size}, L, {text_dim}), got {tuple(text.shape)}")
        sigma = self.sample_sigmas(batch_size, grid[1] * grid[2], latents.device)
        noise = torch.randn(latents.shape, device=latents.device, dtype=torch.float32)
        if self.hparams.caption_dropout > 0:
            text = self.drop_captions(text)
        per_sample = self.per_sample_loss(latents, text, sigma, noise)
        hp = self.hparams
        loss, count = objective.weighted_step_loss(per_sample, math.prod(grid), hp.loss_weighting,
                                                   hp.loss_reference_tokens)
        if count is not None:
            loss = scale_loss_to_global_mean(loss, count)
        local = per_sample.mean().detach()
        self.log("train/loss", local, batch_size=batch_size, prog_bar=True)
        return {"loss": loss, "local_loss": local}

    # -- optimization --

    def configure_optimizers(self):
        """AdamW, and with `warmup_steps` a per-step linear warm-up to `lr`: lr * (step + 1) /
        warmup_steps for the first warmup_steps optimizer steps, then lr."""
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas))
        if not hp.warmup_steps:
            return optimizer
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / hp.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        """The optimizer's step, then (ema_decay) the EMA update of the weights (ema.py)."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self.hparams.ema_decay is not None:  # Lightning passes its LightningOptimizer wrapper
            ema.update_ema(getattr(optimizer, "optimizer", optimizer), self.hparams.ema_decay)
