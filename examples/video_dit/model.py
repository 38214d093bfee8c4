"""A Wan-2.1-style video diffusion transformer, sized by config from a CPU toy to Wan-1.3B.

Data flow: latents (B, C, T, H, W) -> Conv3d patch embedding -> tokens (B, N, D) with
N = T/pt * H/ph * W/pw -> `num_layers` DiTBlocks (AdaLN-modulated self-attention with 3D RoPE,
text cross-attention, AdaLN-modulated FFN) -> AdaLN head -> unpatchify -> (B, C_out, T, H, W).

The block keeps Wan 2.1's numerics and names (see docs/architecture.md, "examples/video_dit"):
`norm1`/`norm2` are non-affine LayerNorms whose outputs are modulated in fp32 and cast back once;
`norm3` (before cross-attention) is affine and not modulated; `modulation` is a (1, 6, D)
parameter added to the (B, 6, D) time projection, chunked as shift, scale, gate (self-attention)
then shift, scale, gate (FFN). examples/video_dit/surgery.py patches these blocks by those names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class DiTConfig:
    """Model shape. Defaults are Wan 2.1 T2V-1.3B."""

    in_channels: int = 16
    out_channels: int = 16
    dim: int = 1536
    num_layers: int = 30
    num_heads: int = 12
    ffn_dim: int = 8960
    text_dim: int = 4096
    freq_dim: int = 256  # width of the sinusoidal timestep embedding
    patch: tuple[int, int, int] = (1, 2, 2)
    eps: float = 1e-6
    activation_checkpointing: bool = False  # recompute each block in backward (saves activations)

    def __post_init__(self) -> None:
        positive = ("in_channels", "out_channels", "dim", "num_layers", "num_heads", "ffn_dim", "text_dim", "freq_dim")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"DiTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.num_heads:
            raise ValueError(f"DiTConfig.dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        head_dim = self.dim // self.num_heads
        if head_dim % 2 or head_dim < 6:
            raise ValueError(f"DiTConfig: head dim dim/num_heads = {head_dim} must be even and >= 6 for 3D RoPE")
        if self.freq_dim % 2:
            raise ValueError(f"DiTConfig.freq_dim must be even, got {self.freq_dim}")
        if len(self.patch) != 3 or any(int(p) < 1 for p in self.patch):
            raise ValueError(f"DiTConfig.patch must be three integers >= 1, got {self.patch}")


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding (B, dim) fp64, [cos, sin], of flow times t (B,) in [0, 1] scaled to
    [0, 1000] like Wan's 1000 training timesteps (fp64: the arguments reach 1000 rad)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float64, device=t.device) / half)
    args = (t.double() * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=1)


def rope_split(head_dim: int) -> tuple[int, int, int]:
    """Head-dim channels given to the (t, h, w) axes, Wan's split: h and w get 2*(d//6) each."""
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def rope_3d(grid: tuple[int, int, int], head_dim: int, device: torch.device, theta: float = 10000.0):
    """cos, sin of shape (N, head_dim // 2) fp32 for a (T, H, W) token grid, N = T*H*W in
    row-major (t, h, w) order; each axis rotates its own slice of channel pairs."""
    angles = []
    for axis, (size, width) in enumerate(zip(grid, rope_split(head_dim))):
        inv_freq = 1.0 / theta ** (torch.arange(0, width, 2, dtype=torch.float64, device=device) / width)
        pos = torch.arange(size, dtype=torch.float64, device=device)
        shape = [1, 1, 1, width // 2]
        shape[axis] = size
        angles.append((pos[:, None] * inv_freq[None]).view(shape).expand(*grid, width // 2))
    angle = torch.cat(angles, dim=-1).reshape(-1, head_dim // 2)
    return torch.cos(angle).float(), torch.sin(angle).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of x (B, heads, N, head_dim) by angles cos/sin (N, head_dim/2)."""
    x_pairs = x.to(torch.promote_types(x.dtype, torch.float32)).unflatten(-1, (-1, 2))
    real, imag = x_pairs.unbind(-1)
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """q, k, v, o projections and RMS-normed q and k of Wan 2.1's attention; heads of dim D/h."""

    def __init__(self, dim: int, num_heads: int, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # (B, N, D) -> (B, h, N, d)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class SelfAttention(Attention):
    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q = apply_rope(self.heads(self.norm_q(self.q(x))), *rope)
        k = apply_rope(self.heads(self.norm_k(self.k(x))), *rope)
        return self.attend(q, k, self.heads(self.v(x)))


class CrossAttention(Attention):
    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """x (B, N, D) attends to the text context (B, L, D)."""
        q = self.heads(self.norm_q(self.q(x)))
        k = self.heads(self.norm_k(self.k(context)))
        return self.attend(q, k, self.heads(self.v(context)))


class DiTBlock(nn.Module):
    """One Wan 2.1 transformer block. x (B, N, D), e (B, 6, D) fp32 time projection,
    context (B, L, D) text tokens, rope cos/sin (N, head_dim/2)."""

    def __init__(self, dim: int, ffn_dim: int, num_heads: int, eps: float = 1e-6):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.self_attn = SelfAttention(dim, num_heads, eps)
        self.norm3 = nn.LayerNorm(dim, eps=eps, elementwise_affine=True)
        self.cross_attn = CrossAttention(dim, num_heads, eps)
        self.norm2 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor, context: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # Wan 2.1 keeps the modulation path in fp32 even under bf16 autocast: each (B, 1, D)
        # chunk is fp32 (fp64 for fp64 inputs), the modulated norm output is cast back once.
        acc = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            shift_msa, scale_msa, gate_msa, shift_ffn, scale_ffn, gate_ffn = (
                self.modulation.to(acc) + e.to(acc)).chunk(6, dim=1)
            h = (self.norm1(x.to(acc)) * (1 + scale_msa) + shift_msa).type_as(x)
        y = self.self_attn(h, rope)
        with torch.autocast(device_type=x.device.type, enabled=False):
            x = (x.to(acc) + y.to(acc) * gate_msa).type_as(x)
        x = x + self.cross_attn(self.norm3(x), context).type_as(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            h = (self.norm2(x.to(acc)) * (1 + scale_ffn) + shift_ffn).type_as(x)
        y = self.ffn(h)
        with torch.autocast(device_type=x.device.type, enabled=False):
            x = (x.to(acc) + y.to(acc) * gate_ffn).type_as(x)
        return x


class Head(nn.Module):
    """Final AdaLN (shift, scale from a (1, 2, D) parameter + time embedding) and projection
    to patch pixels: (B, N, D) -> (B, N, C_out * pt * ph * pw)."""

    def __init__(self, dim: int, out_features: int, eps: float):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.head = nn.Linear(dim, out_features)
        self.modulation = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, time_emb: torch.Tensor) -> torch.Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            shift, scale = (self.modulation.to(acc) + time_emb.to(acc)[:, None]).chunk(2, dim=1)
            h = (self.norm(x.to(acc)) * (1 + scale) + shift).type_as(x)
        return self.head(h)


class VideoDiT(nn.Module):
    """forward(latents (B, C, T, H, W), t (B,) in [0, 1], text (B, L, text_dim)) ->
    velocity prediction (B, C_out, T, H, W). T, H, W must be multiples of the patch."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.config = c = config
        self.patch_embedding = nn.Conv3d(c.in_channels, c.dim, kernel_size=c.patch, stride=c.patch)
        self.text_embedding = nn.Sequential(nn.Linear(c.text_dim, c.dim), nn.GELU(approximate="tanh"),
                                            nn.Linear(c.dim, c.dim))
        self.time_embedding = nn.Sequential(nn.Linear(c.freq_dim, c.dim), nn.SiLU(), nn.Linear(c.dim, c.dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(c.dim, 6 * c.dim))
        self.blocks = nn.ModuleList(DiTBlock(c.dim, c.ffn_dim, c.num_heads, c.eps) for _ in range(c.num_layers))
        self.head = Head(c.dim, c.out_channels * math.prod(c.patch), c.eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Wan-style init: xavier-uniform linears with zero bias, N(0, 0.02) embeddings."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.xavier_uniform_(self.patch_embedding.weight.flatten(1))
        for seq in (self.text_embedding, self.time_embedding):
            for module in seq:
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=0.02)

    def forward(self, latents: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        c = self.config
        if latents.ndim != 5 or latents.shape[1] != c.in_channels:
            raise ValueError(f"latents must be (B, {c.in_channels}, T, H, W), got {tuple(latents.shape)}")
        if any(size % p for size, p in zip(latents.shape[2:], c.patch)):
            raise ValueError(f"latent (T, H, W) = {tuple(latents.shape[2:])} is not a multiple of patch {c.patch}")
        if text.ndim != 3 or text.shape[0] != latents.shape[0] or text.shape[2] != c.text_dim:
            raise ValueError(f"text must be ({latents.shape[0]}, L, {c.text_dim}), got {tuple(text.shape)}")
        x = self.patch_embedding(latents)  # (B, D, T', H', W')
        grid = tuple(x.shape[2:])
        x = x.flatten(2).transpose(1, 2)  # (B, N, D)
        rope = rope_3d(grid, c.dim // c.num_heads, x.device)
        with torch.autocast(device_type=x.device.type, enabled=False):  # fp32 under mixed precision
            sinusoid = timestep_embedding(t, c.freq_dim).to(self.time_embedding[0].weight.dtype)
            time_emb = self.time_embedding(sinusoid)  # (B, D)
            e = self.time_projection(time_emb).unflatten(1, (6, c.dim))  # (B, 6, D)
        context = self.text_embedding(text)
        for block in self.blocks:
            if c.activation_checkpointing and self.training:
                x = checkpoint(block, x, e, context, rope, use_reentrant=False)
            else:
                x = block(x, e, context, rope)
        return unpatchify(self.head(x, time_emb), grid, c.patch, c.out_channels)


def unpatchify(x: torch.Tensor, grid: tuple[int, int, int], patch: tuple[int, int, int],
               channels: int) -> torch.Tensor:
    """(B, N, C*pt*ph*pw) tokens in (t, h, w) order -> (B, C, T'*pt, H'*ph, W'*pw)."""
    (gt, gh, gw), (pt, ph, pw) = grid, patch
    x = x.reshape(x.shape[0], gt, gh, gw, pt, ph, pw, channels)
    return x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(x.shape[0], channels, gt * pt, gh * ph, gw * pw)


def flow_matching_loss(model: nn.Module, latents: torch.Tensor, text: torch.Tensor, t: torch.Tensor,
                       noise: torch.Tensor) -> torch.Tensor:
    """Rectified-flow loss, mean over the batch of each sample's mean squared error:
    x_t = (1 - t) x0 + t noise, the model predicts the velocity noise - x0 at (x_t, t).
    latents, noise (B, C, T, H, W); t (B,) in [0, 1]; returns a scalar fp32 tensor."""
    t_ = t.view(-1, *([1] * (latents.ndim - 1))).to(latents.dtype)
    x_t = (1 - t_) * latents + t_ * noise
    pred = model(x_t, t, text)
    per_sample = (pred.float() - (noise - latents).float()).pow(2).flatten(1).mean(dim=1)
    return per_sample.mean()
