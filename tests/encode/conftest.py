"""Tiny random encoders (no downloads) and media written by the tests themselves.

The VAE is diffusers' AutoencoderKLWan with a small config (4 latent channels, Wan's 4x8x8 strides,
non-trivial latents_mean/std), the text encoder transformers' UMT5EncoderModel with a small config
and a word-level tokenizer built with `tokenizers`; both random, seeded, saved to local folders in
the layout of a Wan diffusers pipeline (vae/, text_encoder/, tokenizer/)."""
import fractions
import io
import tarfile

import numpy as np
import pytest
import torch

av = pytest.importorskip("av", reason="the [encode] extra (PyAV) is not installed")
pytest.importorskip("transformers", reason="the [encode] extra (transformers) is not installed")

Z_DIM, TEXT_DIM, TEXT_LEN = 4, 32, 16
LATENTS_MEAN = [0.1, -0.2, 0.3, 0.0]
LATENTS_STD = [1.5, 0.5, 2.0, 1.0]
WORDS = "a cat dog runs on the grass red blue car sky sea jumps over".split()
# images 32x32 and 32x48, clips of 5, 9 or 17 frames at both
GRID = [(1, 32, 32), (1, 32, 48)] + [(f, 32, w) for f in (5, 9, 17) for w in (32, 48)]
BITS = 6  # a test frame shows its index as BITS vertical stripes, white = 1


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread: the tiny convolutions run ~20x faster than with two contending threads
    on the shared 2-core machine."""


def tiny_vae(**overrides):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    config = dict(base_dim=4, z_dim=Z_DIM, dim_mult=[1, 1, 1, 1], num_res_blocks=1, latents_mean=LATENTS_MEAN,
                  latents_std=LATENTS_STD)
    return AutoencoderKLWan(**{**config, **overrides}).eval()


def tiny_text_encoder():
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(1)
    config = UMT5Config(vocab_size=len(WORDS) + 3, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                        relative_attention_num_buckets=8, relative_attention_max_distance=16)
    return UMT5EncoderModel(config).eval()


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def pipeline_dir(tmp_path_factory):
    """A folder laid out like a Wan diffusers pipeline: vae/, text_encoder/, tokenizer/."""
    root = tmp_path_factory.mktemp("wan_tiny")
    tiny_vae().save_pretrained(root / "vae")
    tiny_text_encoder().save_pretrained(root / "text_encoder")
    tiny_tokenizer().save_pretrained(root / "tokenizer")
    return root


def index_frame(i: int, height: int = 48, width: int = 64) -> np.ndarray:
    """(height, width, 3) uint8 showing `i` in binary: BITS vertical stripes, bit b white when set."""
    frame = np.zeros((height, width, 3), np.uint8)
    stripe = width // BITS
    for b in range(BITS):
        if i >> b & 1:
            frame[:, b * stripe:(b + 1) * stripe] = 255
    return frame


def read_index(frame) -> int:
    """The index an `index_frame` shows, read back from a decoded (resized, cropped) frame: the
    crop only cuts rows, so stripe b is still at columns b/BITS .. (b+1)/BITS of the width."""
    frame = np.asarray(frame, dtype=np.float32)
    width = frame.shape[1]
    value = 0
    for b in range(BITS):
        lo, hi = int((b + 0.3) * width / BITS), int((b + 0.7) * width / BITS)
        value |= int(frame[:, lo:hi].mean() > 127) << b
    return value


def write_video(path, frames, fps: int = 24, pts_ms=None) -> None:
    """An mpeg4 .mp4 of `frames` ((N, H, W, 3) uint8) at `fps`, or at presentation times `pts_ms`
    (milliseconds: a variable frame rate)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        stream.bit_rate = 4_000_000
        if pts_ms is not None:
            stream.codec_context.time_base = fractions.Fraction(1, 1000)
        for i, pixels in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
            if pts_ms is not None:
                frame.pts, frame.time_base = int(pts_ms[i]), fractions.Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def index_video(path, n: int, fps: int = 24, pts_ms=None, height: int = 48, width: int = 64) -> None:
    write_video(path, [index_frame(i, height, width) for i in range(n)], fps, pts_ms)


def write_image(path, seed: int, height: int = 40, width: int = 56) -> np.ndarray:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return pixels


def vae_reference(vae, frames: torch.Tensor) -> np.ndarray:
    """Wan-normalized posterior mean of (F, h, w, 3) uint8 frames, computed here by hand: pixels to
    [-1, 1], diffusers' encode, (mean - latents_mean) / latents_std."""
    x = frames.permute(3, 0, 1, 2)[None].float() / 127.5 - 1
    with torch.no_grad():
        mean = vae.encode(x).latent_dist.mean[0]
    m = torch.tensor(LATENTS_MEAN).view(-1, 1, 1, 1)
    s = torch.tensor(LATENTS_STD).view(-1, 1, 1, 1)
    return ((mean - m) / s).numpy()


def write_tar(path, members: dict[str, bytes]) -> None:
    """A plain tar of `members` (name -> bytes), as WebDataset shards of clips are."""
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
