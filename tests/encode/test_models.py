"""The encoders against the libraries' own outputs: VAE latents (mean, sample, tiling) and UMT5 text."""
import numpy as np
import pytest
import torch

from lightning_adaptiveload.encode.models import (CaptionEncoder, LatentEncoder, compute_dtype, load_text_encoder,
                                                  load_tokenizer, load_vae)

from tests.encode.conftest import LATENTS_STD, TEXT_LEN, Z_DIM, tiny_vae, vae_reference

CPU = torch.device("cpu")


def _frames(seed, f, h, w):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (f, h, w, 3), dtype=np.uint8))


def test_latent_is_the_normalized_posterior_mean_with_the_frame_rule_shape(pipeline_dir):
    vae = load_vae(pipeline_dir)  # a pipeline folder: vae/ is found
    encoder = LatentEncoder(vae, device=CPU, dtype=torch.float32)
    for f, h, w in ((17, 32, 48), (1, 32, 32), (9, 16, 32)):
        frames = _frames(f, f, h, w)
        latent = encoder.encode(frames, "k")
        assert latent.shape == (Z_DIM, 1 + (f - 1) // 4, h // 8, w // 8)
        np.testing.assert_allclose(latent, vae_reference(tiny_vae(), frames), rtol=1e-5, atol=1e-5)


def test_sample_is_seeded_by_key_and_distributed_around_the_mean():
    frames = _frames(0, 17, 32, 48)
    mean = LatentEncoder(tiny_vae(), device=CPU, dtype=torch.float32).encode(frames, "k")
    sampler = LatentEncoder(tiny_vae(), device=CPU, dtype=torch.float32, latent="sample")
    a, b, other = sampler.encode(frames, "k"), sampler.encode(frames, "k"), sampler.encode(frames, "k2")
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, other)
    x = frames.permute(3, 0, 1, 2)[None].float() / 127.5 - 1
    with torch.no_grad():
        std = tiny_vae().encode(x).latent_dist.std[0].numpy()
    # (sample - mean) in VAE units over the posterior std is N(0, 1): 480 draws
    z = (a - mean) * np.array(LATENTS_STD).reshape(-1, 1, 1, 1) / std
    assert abs(z.mean()) < 0.2 and abs(z.std() - 1) < 0.15


def test_large_frames_are_tiled_like_diffusers_tiling():
    frames = _frames(1, 1, 288, 288)  # > diffusers' 256-pixel tile
    tiled = LatentEncoder(tiny_vae(), device=CPU, dtype=torch.float32, tile_above=256 * 256).encode(frames, "k")
    whole = LatentEncoder(tiny_vae(), device=CPU, dtype=torch.float32, tile_above=None).encode(frames, "k")
    reference_vae = tiny_vae()
    reference_vae.enable_tiling()
    np.testing.assert_allclose(tiled, vae_reference(reference_vae, frames), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(whole, vae_reference(tiny_vae(), frames), rtol=1e-5, atol=1e-5)
    assert not np.allclose(tiled, whole, atol=1e-4)  # tiles blend: the tiled path really ran


def test_vae_without_latent_statistics_is_refused():
    vae = tiny_vae()
    vae.register_to_config(latents_mean=None)
    with pytest.raises(ValueError, match="latents_mean and latents_std of 4 values"):
        LatentEncoder(vae, device=CPU, dtype=torch.float32)


def test_caption_embedding_is_the_unpadded_encoding_of_its_tokens(pipeline_dir):
    model = load_text_encoder(pipeline_dir)
    tokenizer = load_tokenizer(pipeline_dir)
    encoder = CaptionEncoder(model, tokenizer, device=CPU, dtype=torch.float32, text_len=TEXT_LEN)
    text = encoder.encode("a red car jumps over the dog")
    assert text.shape == (7 + 1, 32)  # seven words and the end token
    ids = torch.tensor([tokenizer("a red car jumps over the dog")["input_ids"]])
    with torch.no_grad():
        ref = model(input_ids=ids).last_hidden_state[0].numpy()  # no padding at all
    np.testing.assert_allclose(text, ref, rtol=1e-5, atol=1e-5)
    long = encoder.encode(" ".join(["sky"] * 40))
    assert long.shape == (TEXT_LEN, 32)  # truncated to text_len


def test_precision_and_missing_weights():
    assert compute_dtype(torch.device("cuda"), "auto") == torch.bfloat16
    assert compute_dtype(CPU, "auto") == torch.float32
    assert compute_dtype(CPU, "bf16") == torch.bfloat16
    with pytest.raises(FileNotFoundError, match="VAE weights: no such folder /nonexistent"):
        load_vae("/nonexistent")
