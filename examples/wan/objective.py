"""Wan 2.1's flow-matching objective, the parts that need no model: noise levels (sampling and the
timestep shift), caption dropout to the empty prompt, and how a step's loss weighs its samples.

Noise levels. u ~ U(0, 1) ("uniform", what Wan, DiffSynth-Studio and musubi-tuner train with) or
u = sigmoid(N(mean, std)) ("logit_normal", SD3's choice), then the timestep shift
sigma = s u / (1 + (s - 1) u), which moves every level toward 1 (more noise) for s > 1.

The shift. "fixed" (the default) gives every sample s = `shift`, as every reference trainer does
(docs/lightning.md, "Training Wan 2.1"); the default 3.0 is diffusers' default flow_shift for Wan and
the value its pipeline documents for 480p (5.0 for 720p), the resolution Wan 2.1 T2V 1.3B is
published for; FastVideo's 1.3B config uses 3 too, musubi-tuner's docs 3. "sqrt_area" is SD3's
resolution-dependent shift (Esser et al. 2024, section 5.3.2) on the frame alone:
s = max(shift_min, shift * sqrt(A / A_ref)), A the transformer tokens of one latent frame
(H/ph * W/pw). With shift 3 at a 480x832 frame (A_ref = 30 x 52 = 1,560) it gives 4.6 at 720x1280
(3,600 tokens), close to diffusers' 5 for 720p, and 1.2 for a 256x256 image; the floor (default 1)
keeps small images from training mostly near clean (s < 1). No frame-count term: the 480p/720p pair
is the only measured anchor, and a sqrt(T) factor (Open-Sora 2) would give a 17-frame clip and an
81-frame clip of the same frames different noise levels with no published Wan value to check it.
Unmeasured for Wan either way: keep "fixed" unless you test it.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch

TIMESTEP_SAMPLINGS = ("uniform", "logit_normal")
SHIFT_RULES = ("fixed", "sqrt_area")
LOSS_WEIGHTINGS = ("sample", "token")


def shift_sigmas(sigma: torch.Tensor, shift: float | torch.Tensor) -> torch.Tensor:
    """The timestep shift s u / (1 + (s - 1) u) of noise levels u in [0, 1] (any shape; `shift`
    a number or a tensor broadcasting to it, > 0). It keeps 0 and 1 fixed and is the identity at
    s = 1; s > 1 moves every level toward 1 (more noise). Same as Flux's exp(mu) / (exp(mu) +
    1/u - 1) with s = exp(mu)."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def area_shift(frame_tokens: int, shift: float, reference_tokens: int, minimum: float) -> float:
    """s(A) = max(minimum, shift * sqrt(A / reference_tokens)) for frames of A transformer tokens:
    `shift` at the reference frame, growing like the frame's side length (module docstring)."""
    return max(minimum, shift * math.sqrt(frame_tokens / reference_tokens))


def sample_noise_levels(batch_size: int, shift: float, sampling: str, logit_mean: float, logit_std: float,
                        device: torch.device | str, generator: torch.Generator | None = None) -> torch.Tensor:
    """(batch_size,) fp32 noise levels in [0, 1]: u by `sampling` (TIMESTEP_SAMPLINGS), then shifted
    by `shift`. Draws from `generator` (None: the global RNG, which Lightning's seed_everything sets)."""
    if sampling == "uniform":
        u = torch.rand(batch_size, device=device, generator=generator)
    else:
        u = torch.sigmoid(logit_mean + logit_std * torch.randn(batch_size, device=device, generator=generator))
    return shift_sigmas(u, shift)


# -- caption dropout --

def fit_to_length(embedding: torch.Tensor, length: int) -> torch.Tensor:
    """(L_e, D) -> (length, D): cut to `length` rows or zero-padded after them, as captions are
    (data/shards.py, `write_text`: text encoders pad their context with zeros)."""
    out = embedding.new_zeros(length, embedding.shape[1])
    n = min(length, embedding.shape[0])
    out[:n] = embedding[:n]
    return out


def drop_captions(text: torch.Tensor, drop: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """text (B, L, D) with the rows of samples where `drop` (B,) bool is True replaced by `empty`
    (L_e, D), fitted to L (`fit_to_length`); in text's dtype and device. No host sync: a select,
    not indexing by a mask."""
    empty = fit_to_length(empty.to(device=text.device, dtype=text.dtype), text.shape[1])
    return torch.where(drop.view(-1, 1, 1), empty.unsqueeze(0), text)


def find_empty_prompt(shard_folders: list[Path]) -> tuple[torch.Tensor, Path] | None:
    """The empty prompt's (L, D) embedding written beside the shards (data/shards.py,
    EMPTY_PROMPT_FILE) and the file it came from, or None when no folder has one. Shards from
    several folders must agree: one text encoder's empty prompt; ValueError naming both files if not."""
    from lightning_adaptiveload.data.shards import EMPTY_PROMPT_FILE, read_empty_prompt

    found: tuple[torch.Tensor, Path] | None = None
    for folder in dict.fromkeys(shard_folders):  # each folder once, in order
        path = Path(folder) / EMPTY_PROMPT_FILE
        if not path.is_file():
            continue
        embedding = torch.from_numpy(read_empty_prompt(path)).float()
        if found is None:
            found = (embedding, path)
        elif found[0].shape != embedding.shape or not torch.equal(found[0], embedding):
            raise ValueError(f"the empty-prompt embeddings {found[1]} and {path} differ: shards encoded with "
                             "different text encoders cannot share one caption dropout target; set "
                             "model.empty_prompt to the one to train with")
    return found


def warn_zero_context(where: str) -> None:
    """The one warning for caption dropout without an empty-prompt embedding."""
    warnings.warn(f"WanModule: caption dropout found no empty-prompt embedding ({where}); dropped captions "
                  "become an all-zero text context. Sample with the same zero context for classifier-free "
                  "guidance, or encode the dataset with `adaptiveload encode` (it writes the embedding beside the "
                  "shards) or set model.empty_prompt.", RuntimeWarning, stacklevel=3)


# -- loss weighting --

def weighted_step_loss(per_sample: torch.Tensor, tokens: int, weighting: str, reference_tokens: int | None
                       ) -> tuple[torch.Tensor, int | None]:
    """This rank's loss to backpropagate before the cross-rank rescaling, and the count to rescale
    it by (`scale_loss_to_global_mean`), from per_sample (B,) fp32 mean squared errors of samples
    of `tokens` transformer tokens each.

    "sample": the mean over the batch and count B: with the rescaling, the step's gradient is that of
    the mean over every sample of the global batch, and every step weighs 1, so one B = 1 long clip
    weighs as much as a B = 40 image batch. "token": sum over the batch's tokens of each token's mean
    squared error, divided by `reference_tokens` (per rank), and no rescaling (None): every token of
    every step and rank weighs 1 / (world_size * reference_tokens) once gradients are averaged over
    ranks, so a step weighs its tokens (a step of reference_tokens tokens on every rank weighs as a
    "sample" step does). Each token covers the same C * pt * ph * pw latent elements, so a token's mean
    is its elements' mean and a sample's sum over tokens is tokens * its mean."""
    if weighting == "sample":
        return per_sample.mean(), per_sample.shape[0]
    return per_sample.sum() * (tokens / reference_tokens), None
