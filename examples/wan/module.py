"""LightningModule training diffusers' Wan 2.1 transformer (`WanTransformer3DModel`) with Wan's
flow-matching objective on the AdaptiveLoadDataModule's batches, under one device, DDP, FSDP1
(`FSDPStrategy`) or FSDP2 (`ModelParallelStrategy`).

Objective (rectified flow, as Wan 2.1 and diffusers' flow-match schedulers define it): for a clean
latent x0 (B, C, T, H, W), noise n ~ N(0, 1) of the same shape and a noise level sigma in [0, 1]
per sample, x_t = (1 - sigma) x0 + sigma n; the transformer gets x_t, timestep = 1000 sigma (a
float in [0, 1000], the scale of Wan's 1000 training timesteps) and the text embeddings, and
predicts the velocity v = n - x0; the loss is the mean squared error, in fp32.

Noise levels: u ~ U(0, 1) or logit-normal (sigmoid of N(mean, std)), then the timestep shift
sigma = s u / (1 + (s - 1) u), which moves samples toward high noise for s > 1. `shift_rule`:
"fixed": s = `shift` for every sample; "sqrt_tokens": s = `shift` * sqrt(N / `shift_reference_tokens`),
with N the sample's transformer tokens (T/pt * H/ph * W/pw of its latent): the resolution-dependent
shift of SD3 (Esser et al. 2024, section 5.3.2) and Open-Sora 1.2's `timestep_transform`, applied to
video tokens. Why tokens: the more tokens carry the same content (a longer clip, a larger frame),
the more of the signal survives a given noise level, so one fixed shift is too weak for long 720p
videos or too strong for images. The defaults, s = 5 at 75,600 tokens (81 frames of 720x1280, Wan's
720p clip), give s = 3.3 at 480p x 81 frames (32,760 tokens) and 1.1 for a 720p image (3,600 tokens):
5 and 3 are the shifts diffusers' Wan pipeline documents for 720p and 480p (`flow_shift`), and 5
is what DiffSynth-Studio and VideoX-Fun train Wan with (docs/lightning.md, "Training Wan 2.1").
"""
from __future__ import annotations

import inspect
import json
import math
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_adaptiveload.clipping import FSDPNormClipping
from lightning_adaptiveload._validation import require_int, require_number
from lightning_adaptiveload.loss import scale_loss_to_global_mean

# diffusers' WanTransformer3DModel arguments of Wan 2.1 T2V 1.3B (the published
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json); the class's own defaults are the 14B.
WAN21_T2V_1_3B: dict[str, Any] = {
    "patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
    "added_kv_proj_dim": None, "rope_max_seq_len": 1024, "pos_embed_seq_len": None,
}
NUM_TRAIN_TIMESTEPS = 1000  # the model's timestep input is sigma * 1000
TIMESTEP_SAMPLINGS = ("uniform", "logit_normal")
SHIFT_RULES = ("fixed", "sqrt_tokens")
COMPILE_MODES = {"static": False, "auto": None, "dynamic": True}  # -> block.compile(dynamic=...)
FSDP2_PARAM_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def shift_sigmas(sigma: torch.Tensor, shift: float | torch.Tensor) -> torch.Tensor:
    """The timestep shift s u / (1 + (s - 1) u) of noise levels u in [0, 1] (any shape; `shift`
    a number or a tensor broadcasting to it, > 0). It keeps 0 and 1 fixed and is the identity at
    s = 1; s > 1 moves every level toward 1 (more noise). Same as Flux's exp(mu) / (exp(mu) +
    1/u - 1) with s = exp(mu)."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def token_dependent_shift(tokens: int, shift: float, reference_tokens: int) -> float:
    """s(N) = shift * sqrt(N / reference_tokens) for a sample of N transformer tokens: `shift` at
    the reference length, growing like sqrt(N) (SD3's resolution-dependent shift). Dimensionless."""
    return shift * math.sqrt(tokens / reference_tokens)


def _check_transformer_config(overrides: dict[str, Any]) -> None:
    from diffusers import WanTransformer3DModel

    known = set(inspect.signature(WanTransformer3DModel.__init__).parameters) - {"self"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"WanModule: transformer_config has keys WanTransformer3DModel does not take: {unknown} "
                         f"(known: {sorted(known)})")


def load_pretrained_transformer(path: str):
    """A WanTransformer3DModel built from a local folder's config.json, fp32, with the weights of its
    *.safetensors files (sharded ones through `diffusion_pytorch_model.safetensors.index.json`);
    pickled `.bin` weights are never read and nothing is downloaded. `path`: a transformer folder or
    a diffusers pipeline folder holding one under `transformer/`. Loaded here rather than with
    diffusers' `from_pretrained`, which for Wan (fp32-kept modules) requires `accelerate`. Raises
    FileNotFoundError for a folder without config.json or safetensors, ValueError for weights that do
    not match the config (missing or unexpected keys, named)."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    root = Path(path)
    folder = root / "transformer" if (root / "transformer" / "config.json").is_file() else root
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"WanModule: pretrained={path!r} is not a local diffusers transformer folder "
                                "(config.json + safetensors) nor a pipeline folder with transformer/config.json")
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"WanModule: pretrained={path!r}: no *.safetensors weights in {folder} "
                                "(pickled .bin weights are not loaded; convert them to safetensors)")
    model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(folder))
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    missing, unexpected = model.load_state_dict(state, strict=False)  # copies into the fp32 parameters
    ignored = WanTransformer3DModel._keys_to_ignore_on_load_unexpected or []
    unexpected = [key for key in unexpected if not any(pattern in key for pattern in ignored)]
    if missing or unexpected:
        raise ValueError(f"WanModule: pretrained={path!r}: the weights do not match {folder / 'config.json'}: "
                         f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                         f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    return model


class WanModule(FSDPNormClipping):
    """diffusers `WanTransformer3DModel` trained with Wan's flow-matching loss (module docstring).

    transformer_config: WanTransformer3DModel arguments overriding `WAN21_T2V_1_3B` key by key (a
        tiny model for the CPU: fewer layers and heads, small dims). Not allowed with `pretrained`.
    pretrained: a local folder to load the transformer from (`load_pretrained_transformer`); None
        builds it with diffusers' random init.
    build_in_configure_model: build (or load) the transformer in `configure_model` instead of
        `__init__`. Callbacks acting in `setup()` (FusedAdaLNSurgery, PerBucketCheckpointing's early
        wrap) see no blocks then; keep it False with them.
    compile: regional compilation of every `WanTransformerBlock` in `configure_model`, as in the
        example VideoDiT: "auto" (torch's default, static then dynamic after the first recompile;
        docs/lightning.md "Compiled training"), "dynamic", "static" or None (eager).
    timestep_sampling: "uniform" (u ~ U(0, 1)) or "logit_normal" (u = sigmoid(N(logit_mean, logit_std)),
        SD3's choice), before the shift.
    shift_rule, shift, shift_reference_tokens: the timestep shift (module docstring): "fixed" uses
        `shift`; "sqrt_tokens" uses `shift` * sqrt(tokens / shift_reference_tokens) per batch (all
        samples of a batch share one latent shape).
    fsdp2_param_dtype: under ModelParallelStrategy, the dtype FSDP2 gathers parameters in for
        compute ("bfloat16", or "float32" for exact fp32 training); gradients are reduced in fp32
        and the sharded master weights and AdamW state stay fp32 (use precision "32-true" there).
    lr, weight_decay, betas: AdamW.
    """

    def __init__(self, transformer_config: dict[str, Any] | None = None, pretrained: str | None = None,
                 build_in_configure_model: bool = False, compile: str | None = None,
                 timestep_sampling: str = "uniform", logit_mean: float = 0.0, logit_std: float = 1.0,
                 shift_rule: str = "sqrt_tokens", shift: float = 5.0, shift_reference_tokens: int = 75600,
                 fsdp2_param_dtype: str = "bfloat16", lr: float = 1e-4, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999)):
        super().__init__()
        overrides = dict(transformer_config or {})
        if pretrained is not None and overrides:
            raise ValueError("WanModule: give pretrained (its config.json sets the shape) or transformer_config, "
                             f"not both (transformer_config={overrides})")
        _check_transformer_config(overrides)
        for name, value, options in (("compile", compile, COMPILE_MODES), ("timestep_sampling", timestep_sampling,
                                     TIMESTEP_SAMPLINGS), ("shift_rule", shift_rule, SHIFT_RULES),
                                     ("fsdp2_param_dtype", fsdp2_param_dtype, FSDP2_PARAM_DTYPES)):
            if value not in options and not (name == "compile" and value is None):
                raise ValueError(f"WanModule: {name} must be one of {sorted(options)}"
                                 f"{' or None' if name == 'compile' else ''}, got {value!r}")
        require_number("WanModule: shift", shift, positive=True)
        require_number("WanModule: logit_mean", logit_mean)
        require_number("WanModule: logit_std", logit_std, positive=True)
        require_int("WanModule: shift_reference_tokens (tokens)", shift_reference_tokens)
        self.save_hyperparameters()
        config = {**WAN21_T2V_1_3B, **overrides}
        config["patch_size"] = tuple(config["patch_size"])  # YAML gives a list
        self.transformer_kwargs = config  # what a random init builds (a pretrained folder has its own config)
        self.transformer = None if build_in_configure_model else self._build_transformer()
        self._fsdp2_dtype: torch.dtype | None = None  # set once configure_model applied fully_shard

    def _build_transformer(self):
        from diffusers import WanTransformer3DModel

        if self.hparams.pretrained is not None:
            model = load_pretrained_transformer(self.hparams.pretrained)
        else:
            model = WanTransformer3DModel(**self.transformer_kwargs)
        config = model.config
        # the target velocity has the input's channels; image-to-video Wan (in 36, out 16) also takes
        # conditioning channels, which this text-to-video objective does not build
        if config["out_channels"] != config["in_channels"] or config["image_dim"] is not None:
            raise ValueError(f"WanModule trains text-to-video Wan: in_channels == out_channels and no image_dim, got "
                             f"in_channels={config['in_channels']}, out_channels={config['out_channels']}, "
                             f"image_dim={config['image_dim']}")
        return model

    # -- parallelism --

    def configure_model(self) -> None:
        """Build the transformer if deferred, compile its blocks (`compile`), and under
        ModelParallelStrategy shard it with FSDP2, in torchtitan's order: checkpointing (done by
        PerBucketCheckpointing in `setup()`, before this hook), per-block compile, `fully_shard` of
        every WanTransformerBlock, then of the whole transformer. Under FSDPStrategy (FSDP1) the
        strategy wraps the model after this hook (`auto_wrap_policy: [WanTransformerBlock]`).
        Lightning may call it more than once: nothing is built, compiled or sharded twice."""
        if self.transformer is None:
            self.transformer = self._build_transformer()
        mode = self.hparams.compile
        if mode is not None:
            for block in self.transformer.blocks:
                if getattr(block, "_compiled_call_impl", None) is None:
                    block.compile(dynamic=COMPILE_MODES[mode])
        if self._trainer is not None and isinstance(self.trainer.strategy, ModelParallelStrategy) \
                and self._fsdp2_dtype is None:
            self._fully_shard()

    def _fully_shard(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self.device_mesh
        if mesh["tensor_parallel"].size() != 1:
            raise ValueError(f"WanModule shards with FSDP2 only: use ModelParallelStrategy(data_parallel_size=N, "
                             f"tensor_parallel_size=1), got a tensor-parallel size of {mesh['tensor_parallel'].size()}")
        dtype = FSDP2_PARAM_DTYPES[self.hparams.fsdp2_param_dtype]
        # cast_forward_inputs=False: the root would otherwise cast the timestep (sigma * 1000, fp32)
        # to bf16 (steps of 4 near 1000) and the blocks the fp64 RoPE tables; training_step casts
        # latents and text itself.
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
        dp_mesh = mesh["data_parallel"]
        for block in self.transformer.blocks:
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        fully_shard(self.transformer, mesh=dp_mesh, mp_policy=policy)
        self._fsdp2_dtype = dtype

    def input_dtype(self) -> torch.dtype:
        """The dtype latents and text enter the transformer in: FSDP2's compute dtype once sharded
        (it gathers parameters in that dtype and, with cast_forward_inputs off, casts no input),
        else the patch embedding's (fp32 params: autocast, if any, casts inside)."""
        return self._fsdp2_dtype or self.transformer.patch_embedding.weight.dtype

    # -- objective --

    def shift_for(self, tokens: int) -> float:
        """The timestep shift s for samples of `tokens` transformer tokens (module docstring)."""
        hp = self.hparams
        if hp.shift_rule == "fixed":
            return float(hp.shift)
        return token_dependent_shift(tokens, hp.shift, hp.shift_reference_tokens)

    def sample_sigmas(self, batch_size: int, tokens: int, device: torch.device | str) -> torch.Tensor:
        """(batch_size,) fp32 noise levels in [0, 1]: u from `timestep_sampling` (global RNG), then
        shifted with `shift_for(tokens)`."""
        hp = self.hparams
        if hp.timestep_sampling == "uniform":
            u = torch.rand(batch_size, device=device)
        else:
            u = torch.sigmoid(hp.logit_mean + hp.logit_std * torch.randn(batch_size, device=device))
        return shift_sigmas(u, self.shift_for(tokens))

    def tokens_of(self, latents: torch.Tensor) -> int:
        """Transformer tokens per sample of latents (B, C, T, H, W): T/pt * H/ph * W/pw. Raises a
        ValueError naming the problem for latents the transformer cannot take."""
        config = self.transformer.config  # the built model's (pretrained: its config.json)
        channels, patch = config["in_channels"], tuple(config["patch_size"])
        if latents.ndim != 5 or latents.shape[1] != channels:
            raise ValueError(f"WanModule: batch['latents'] must be (B, {channels}, T, H, W), "
                             f"got {tuple(latents.shape)}")
        thw = tuple(latents.shape[2:])
        if any(size % p for size, p in zip(thw, patch)):
            raise ValueError(f"WanModule: latent (T, H, W) = {thw} is not a multiple of patch_size {patch}")
        grid = [size // p for size, p in zip(thw, patch)]
        if max(grid) > config["rope_max_seq_len"]:
            raise ValueError(f"WanModule: latent grid {tuple(grid)} (after patching) exceeds rope_max_seq_len "
                             f"{config['rope_max_seq_len']} on some axis")
        return math.prod(grid)

    def flow_matching_loss(self, latents: torch.Tensor, text: torch.Tensor, sigma: torch.Tensor,
                           noise: torch.Tensor) -> torch.Tensor:
        """Scalar fp32 loss: mean over the batch and every latent element of (pred - (noise - x0))^2,
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
        # every sample of a batch has the same shape: the element mean is the mean of per-sample means
        return (pred.float() - (noise.float() - x0)).pow(2).mean()

    def training_step(self, batch: dict, batch_idx: int) -> dict[str, torch.Tensor]:
        """One step on the DataModule's batch dict (`latents` (B, C, T, H, W), `text` (B, L, D_text);
        the other keys are not read). Draws sigma, then the noise, from the global RNG. Returns
        {"loss": the loss to backpropagate, rescaled by `scale_loss_to_global_mean` so that the
        gradient average over ranks with unequal batch sizes is the mean over every sample of the
        global batch; "local_loss": this rank's unscaled mean loss, detached (what is logged, and
        what callbacks recording the loss read)}."""
        latents, text = batch["latents"], batch["text"]
        tokens = self.tokens_of(latents)
        batch_size = latents.shape[0]
        text_dim = self.transformer.config["text_dim"]
        if text.ndim != 3 or text.shape[0] != batch_size or text.shape[2] != text_dim:
            raise ValueError(f"WanModule: batch['text'] must be ({batch_size}, L, {text_dim}), got {tuple(text.shape)}")
        sigma = self.sample_sigmas(batch_size, tokens, latents.device)
        noise = torch.randn(latents.shape, device=latents.device, dtype=torch.float32)
        loss = self.flow_matching_loss(latents, text, sigma, noise)
        self.log("train/loss", loss.detach(), batch_size=batch_size, prog_bar=True)
        return {"loss": scale_loss_to_global_mean(loss, batch_size), "local_loss": loss.detach()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        return torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas))
