"""The encoders of `adaptiveload encode`, through their own libraries: the Wan VAE
(diffusers `AutoencoderKLWan`) for latents and the UMT5 encoder (transformers `UMT5EncoderModel`
and its tokenizer) for text embeddings. Weights are read from local folders only
(`from_pretrained(path, local_files_only=True)`): nothing is downloaded.
"""
from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import torch

from lightning_adaptiveload.encode._optional import require
from lightning_adaptiveload.scheduling.shapes import TokenSpec

LATENT_MODES = ("mean", "sample")  # the posterior's mean (deterministic) or one draw from it
PRECISIONS = ("auto", "bf16", "fp32")
TILE_ABOVE = 480 * 832  # pixels a frame: larger frames are VAE-encoded in spatial tiles (720p: ~2.3x this)


def compute_dtype(device: torch.device, precision: str = "auto") -> torch.dtype:
    """The encoders' dtype: "auto" is bf16 on a GPU (half the memory and several times the speed
    of fp32, what Wan's own training used for its encoders) and fp32 on a CPU (where bf16 is slow)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if precision == "bf16" else torch.float32


def _load(kind: str, loader, path: str | Path, subfolder: str):
    """`loader.from_pretrained(path)`, from `path/subfolder` when `path` is a whole pipeline folder
    (a diffusers Wan checkout: vae/, text_encoder/, tokenizer/); errors name the path and the class."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{kind} weights: no such folder {path}")
    if (path / subfolder).is_dir():
        path = path / subfolder
    try:
        return loader.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the {kind} ({loader.__name__}) from {path}: {e}") from None


def load_vae(path: str | Path):
    """diffusers AutoencoderKLWan from a local folder (its own, or a pipeline's with vae/)."""
    return _load("VAE", require("diffusers").AutoencoderKLWan, path, "vae")


def load_text_encoder(path: str | Path):
    """transformers UMT5EncoderModel from a local folder (its own, or a pipeline's with text_encoder/)."""
    return _load("text encoder", require("transformers").UMT5EncoderModel, path, "text_encoder")


def load_tokenizer(path: str | Path):
    """The text encoder's tokenizer (transformers AutoTokenizer) from a local folder (a pipeline's: tokenizer/)."""
    return _load("tokenizer", require("transformers").AutoTokenizer, path, "tokenizer")


def _config_dict(config) -> dict:
    """A model config as JSON-able plain data, without the fields that name where or with which
    version it was saved (they do not change what it computes)."""
    items = config.to_dict().items() if hasattr(config, "to_dict") else dict(config).items()
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in sorted(items)
            if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype", "architectures")}


def _to(model, device: torch.device, dtype: torch.dtype):
    """`model` on `device` in `dtype`, in eval mode without gradients; cast only if needed (diffusers
    warns about every dtype cast of a model, even a no-op one)."""
    model = model.to(device)
    if next(model.parameters()).dtype != dtype:
        model = model.to(dtype=dtype)
    return model.eval().requires_grad_(False)


class LatentEncoder:
    """Frames -> Wan-normalized VAE latent of one window.

    `encode(frames (F, h, w, 3) uint8, key)` returns the (C, T, H, W) float32 latent, T = 1 + (F -
    1) / stride_t, H = h / stride_s, W = w / stride_s, normalized per channel with the VAE config's
    `latents_mean` and `latents_std` as Wan's pipelines do ((z - mean) / std): the space the DiT
    trains in. latent="mean" takes the posterior mean; "sample" one draw from it, seeded by the
    sample key and `seed` (the same sample gets the same draw on a rerun). Frames with more than
    `tile_above` pixels are encoded in spatial tiles (diffusers `enable_tiling()`; tiles of 256
    px blended over 64 px), so 81 frames of 720p fit; the VAE is causal in time (it encodes 4
    frames at a time with a feature cache), so long clips need no temporal tiling. One window is
    one batch of 1, so batch slicing (`enable_slicing()`) would change nothing.
    """

    def __init__(self, vae, *, device: torch.device, dtype: torch.dtype, latent: str = "mean",
                 tile_above: int | None = TILE_ABOVE, seed: int = 0):
        if latent not in LATENT_MODES:
            raise ValueError(f"latent must be one of {LATENT_MODES}, got {latent!r}")
        config = vae.config
        mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
        if mean is None or std is None or len(mean) != config.z_dim or len(std) != config.z_dim:
            raise ValueError(f"VAE config needs latents_mean and latents_std of {config.z_dim} values (z_dim) for "
                             f"Wan's latent normalization, got {mean!r} and {std!r}")
        self.vae = _to(vae, device, dtype)
        self.device, self.dtype, self.latent, self.tile_above, self.seed = device, dtype, latent, tile_above, seed
        self.mean = torch.tensor(mean, dtype=torch.float32, device=device).view(-1, 1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=device).view(-1, 1, 1, 1)
        self.channels = int(config.z_dim)
        self.stride_t = int(getattr(config, "scale_factor_temporal", None) or 4)
        self.stride_s = int(getattr(config, "scale_factor_spatial", None) or 8)

    def spec(self, patch: tuple[int, int, int] = (1, 2, 2)) -> TokenSpec:
        """The TokenSpec of this VAE's strides and a DiT patch."""
        return TokenSpec(vae_stride_t=self.stride_t, vae_stride_s=self.stride_s, patch=tuple(patch))

    def describe(self) -> dict:
        """What identifies the latents this encoder writes (a resumed run must match it)."""
        return {"vae": _config_dict(self.vae.config), "latent": self.latent, "seed": self.seed,
                "dtype": str(self.dtype).removeprefix("torch."), "tile_above": self.tile_above}

    @torch.inference_mode()
    def encode(self, frames: torch.Tensor, key: str) -> np.ndarray:
        f, h, w, _ = frames.shape
        x = frames.to(self.device, non_blocking=True).permute(3, 0, 1, 2)[None].float().div_(127.5).sub_(1.0)
        if self.tile_above is not None and h * w > self.tile_above:
            self.vae.enable_tiling()
        else:
            self.vae.disable_tiling()
        posterior = self.vae.encode(x.to(self.dtype)).latent_dist
        if self.latent == "mean":
            z = posterior.mode()
        else:
            generator = torch.Generator(self.device).manual_seed(zlib.crc32(key.encode()) + self.seed)
            z = posterior.sample(generator=generator)
        z = (z[0].float() - self.mean) / self.std
        expected = (self.channels, 1 + (f - 1) // self.stride_t, h // self.stride_s, w // self.stride_s)
        if tuple(z.shape) != expected:
            raise RuntimeError(f"sample {key}: the VAE gave a latent of shape {tuple(z.shape)} for {f}x{h}x{w} frames, "
                               f"expected {expected} from its strides ({self.stride_t}, {self.stride_s})")
        return z.cpu().numpy()


class CaptionEncoder:
    """Caption -> UMT5 text embedding, as Wan's pipelines compute it: tokenized with padding and
    truncation to `text_len` tokens (512: the batches' text_len), encoded with the attention mask,
    and cut to the caption's own tokens (with its end token). `encode(caption)` returns (n, D)
    float32, n <= text_len; the DataModule zero-pads it back to text_len, which is what Wan's
    pipeline feeds the DiT. Storing n rows instead of 512 saves about 10x on disk for
    typical captions."""

    def __init__(self, model, tokenizer, *, device: torch.device, dtype: torch.dtype, text_len: int = 512):
        if text_len < 1:
            raise ValueError(f"text_len must be >= 1, got {text_len}")
        self.model = _to(model, device, dtype)
        self.tokenizer, self.device, self.text_len = tokenizer, device, int(text_len)
        self.dim = int(model.config.d_model)

    def describe(self) -> dict:
        return {"text_encoder": _config_dict(self.model.config), "tokenizer": type(self.tokenizer).__name__,
                "vocab": len(self.tokenizer), "text_len": self.text_len,
                "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch.")}

    @torch.inference_mode()
    def encode(self, caption: str) -> np.ndarray:
        tokens = self.tokenizer([caption], padding="max_length", max_length=self.text_len, truncation=True,
                                add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        mask = tokens["attention_mask"].to(self.device)
        hidden = self.model(input_ids=tokens["input_ids"].to(self.device), attention_mask=mask).last_hidden_state
        return hidden[0, : int(mask.sum())].float().cpu().numpy()
