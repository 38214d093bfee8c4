"""examples/wan/objective.py through WanModule: the timestep shift at hand-picked points, the
distribution of the drawn noise levels against the closed-form CDF of the shifted uniform and
logit-normal (Kolmogorov-Smirnov), caption dropout (its rate against the binomial bound, dropped
samples getting exactly the zero-padded empty prompt, reproducibility, where the empty prompt comes
from), and the token-weighted loss against an fp64 formula over two simulated ranks."""
import math
import tarfile
import types
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from examples.wan.module import WanModule  # noqa: E402
from examples.wan.objective import area_shift, shift_sigmas  # noqa: E402
from lightning_adaptiveload.data.shards import EMPTY_PROMPT_FILE, write_empty_prompt  # noqa: E402

TINY = dict(num_layers=1, num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32,
            freq_dim=32, ffn_dim=64)

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(**kwargs) -> WanModule:
    torch.manual_seed(0)
    module = WanModule(transformer_config=TINY, **kwargs)
    module.log = lambda *args, **kw: None  # no Trainer attached
    return module


def _batch(batch_size=2, thw=(1, 4, 4), text_len=6, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(batch_size, 4, *thw, generator=g),
            "text": torch.randn(batch_size, text_len, 32, generator=g)}


# -- the shift --

@pytest.mark.parametrize("u, shift, expected", [
    (0.5, 5.0, 2.5 / 3.0),      # 5 * 0.5 / (1 + 4 * 0.5)
    (0.25, 3.0, 0.5),           # 0.75 / 1.5
    (0.1, 0.5, 0.05 / 0.95),    # shift < 1 moves toward clean
    (0.37, 1.0, 0.37),          # identity
    (0.0, 5.0, 0.0), (1.0, 5.0, 1.0),  # the ends stay
])
def test_shift_formula_at_hand_picked_points(u, shift, expected):
    got = shift_sigmas(torch.tensor([u], dtype=torch.float64), shift)
    assert got.item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    if 0 < u < 1:  # Flux's form of the same map, exp(mu) / (exp(mu) + 1/u - 1) with exp(mu) = shift
        assert got.item() == pytest.approx(shift / (shift + 1 / u - 1), rel=1e-12)


def test_area_shift_follows_the_frame_side_with_a_floor():
    assert area_shift(1560, 3.0, 1560, 1.0) == 3.0                                   # a 480x832 frame
    assert area_shift(3600, 3.0, 1560, 1.0) == pytest.approx(3 * math.sqrt(3600 / 1560))  # 720x1280: 4.56
    assert area_shift(4 * 1560, 3.0, 1560, 1.0) == pytest.approx(6.0)                # twice the side
    assert area_shift(256, 3.0, 1560, 1.0) == pytest.approx(1.2153, abs=1e-4)        # a 256x256 image
    assert area_shift(16, 3.0, 1560, 1.0) == 1.0                                     # floored, not 0.3
    module = _tiny(shift_rule="sqrt_area")
    assert module.shift_for(3600) == pytest.approx(3 * math.sqrt(3600 / 1560))
    # frames only: the same frame area gives the same shift whatever the clip's length
    seen = []
    module.sample_sigmas = lambda b, frame_tokens, device: seen.append(frame_tokens) or torch.full((b,), 0.5)
    for frames in (1, 3):
        module.training_step(_batch(thw=(frames, 4, 6)), 0)
    assert seen == [6, 6]


def _shifted_cdf(sigma: np.ndarray, shift: float, base_cdf) -> np.ndarray:
    """P(shift(u) <= sigma) = P(u <= u(sigma)), u(sigma) = sigma / (shift - (shift - 1) sigma), the
    inverse of the shift, solved by hand."""
    return base_cdf(sigma / (shift - (shift - 1) * sigma))


@pytest.mark.parametrize("sampling", ["uniform", "logit_normal"])
@pytest.mark.parametrize("rule, frame_tokens, shift", [("fixed", 6, 3.0), ("fixed", 6, 1.0),
                                                       ("sqrt_area", 4 * 1560, 6.0), ("sqrt_area", 16, 1.0)])
def test_noise_levels_follow_the_shifted_distribution(sampling, rule, frame_tokens, shift):
    """The drawn sigma against the CDF of the shifted uniform / logit-normal (an independent formula):
    Kolmogorov-Smirnov at 20,000 draws."""
    from scipy import special, stats

    mean, std = 0.3, 1.1
    module = _tiny(timestep_sampling=sampling, logit_mean=mean, logit_std=std, shift_rule=rule,
                   shift=3.0 if rule == "sqrt_area" else shift)
    torch.manual_seed(11)
    sigma = module.sample_sigmas(20000, frame_tokens, "cpu").double().numpy()
    assert sigma.min() >= 0 and sigma.max() <= 1 and sigma.dtype == np.float64
    if sampling == "uniform":
        def base(u):
            return np.clip(u, 0, 1)
    else:
        def base(u):
            return stats.norm.cdf((special.logit(u) - mean) / std)
    result = stats.kstest(sigma, lambda x: _shifted_cdf(x, shift, base))
    assert result.pvalue > 1e-3, result
    # and a shift off by 20% is rejected: the test can tell shifts apart
    assert stats.kstest(sigma, lambda x: _shifted_cdf(x, shift * 1.2, base)).pvalue < 1e-3


# -- caption dropout --

def test_caption_dropout_rate_is_binomial_and_reproducible_under_the_seed():
    module = _tiny(caption_dropout=0.1, empty_prompt=None)
    text = torch.randn(20000, 3, 32) + 5  # no caption row is all zeros
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no empty prompt: the zero context (tested below)
        torch.manual_seed(5)
        dropped = module.drop_captions(text)
    is_dropped = (dropped == 0).all(dim=(1, 2))
    kept = ~is_dropped
    assert torch.equal(dropped[kept], text[kept])
    n, p, k = 20000, 0.1, int(is_dropped.sum())
    assert abs(k - n * p) <= 5 * math.sqrt(n * p * (1 - p)), k  # 5 binomial standard deviations
    torch.manual_seed(5)
    assert torch.equal(module.drop_captions(text), dropped)  # the same draws under the same seed
    torch.manual_seed(6)
    assert not torch.equal(module.drop_captions(text), dropped)


def _shard_folder(tmp_path, name="shards"):
    folder = tmp_path / name
    folder.mkdir()
    with tarfile.open(folder / "shard-000000.tar", "w"):
        pass
    return folder


def _attach_datamodule(module, shards):
    module._trainer = types.SimpleNamespace(datamodule=types.SimpleNamespace(shards=shards))


def test_dropped_samples_train_on_exactly_the_zero_padded_empty_prompt_from_beside_the_shards(tmp_path):
    folder = _shard_folder(tmp_path)
    empty = np.random.default_rng(0).standard_normal((2, 32)).astype(np.float16)  # 2 tokens, shorter than L = 6
    write_empty_prompt(folder, empty)
    module = _tiny(caption_dropout=0.5)
    _attach_datamodule(module, str(folder))
    seen = {}
    module.transformer.register_forward_hook(
        lambda mod, args, kwargs, out: seen.update(text=kwargs["encoder_hidden_states"]), with_kwargs=True)
    batch = _batch(batch_size=16, seed=3)
    torch.manual_seed(9)
    module.training_step(batch, 0)
    torch.manual_seed(9)  # replay the draws: sigma (16 uniforms), the noise, then the dropout's uniforms
    torch.rand(16)
    torch.randn(batch["latents"].shape)
    drop = torch.rand(16) < 0.5
    assert 0 < int(drop.sum()) < 16
    padded = torch.zeros(6, 32)
    padded[:2] = torch.from_numpy(empty.astype(np.float32))
    for i in range(16):
        expected = padded if drop[i] else batch["text"][i]
        assert torch.equal(seen["text"][i], expected), i


def test_caption_dropout_without_an_empty_prompt_drops_to_zeros_and_warns_once(tmp_path):
    module = _tiny(caption_dropout=0.5)
    _attach_datamodule(module, str(_shard_folder(tmp_path)))  # synthetic shards: no empty prompt beside them
    with pytest.warns(RuntimeWarning, match="all-zero text context") as record:
        for seed in range(3):
            torch.manual_seed(seed)
            module.training_step(_batch(batch_size=8), 0)
    assert len([w for w in record if "all-zero" in str(w.message)]) == 1
    text = torch.randn(8, 6, 32) + 3
    torch.manual_seed(1)
    out = module.drop_captions(text)
    rows = [torch.equal(out[i], torch.zeros(6, 32)) or torch.equal(out[i], text[i]) for i in range(8)]
    assert all(rows) and any(torch.equal(out[i], torch.zeros(6, 32)) for i in range(8))


def test_empty_prompt_sources_and_errors(tmp_path):
    # an explicit file, cut to the captions' length when longer
    long = np.random.default_rng(1).standard_normal((9, 32)).astype(np.float32)
    path = write_empty_prompt(tmp_path, long)
    module = _tiny(caption_dropout=0.5, empty_prompt=str(path))
    torch.manual_seed(0)
    out = module.drop_captions(torch.randn(40, 6, 32) + 3)
    dropped = [i for i in range(40) if torch.equal(out[i], torch.from_numpy(long[:6]))]
    assert 0 < len(dropped) < 40
    # the wrong width names the file
    narrow = tmp_path / "narrow"
    narrow.mkdir()
    write_empty_prompt(narrow, np.zeros((1, 16), dtype=np.float32))
    with pytest.raises(ValueError, match=f"{EMPTY_PROMPT_FILE}.*16.*32 channels"):
        _tiny(caption_dropout=0.5, empty_prompt=str(narrow)).drop_captions(torch.randn(4, 6, 32))
    # shards in two folders with different empty prompts
    first, second = _shard_folder(tmp_path, "a"), _shard_folder(tmp_path, "b")
    write_empty_prompt(first, np.ones((1, 32), dtype=np.float32))
    write_empty_prompt(second, np.full((1, 32), 2, dtype=np.float32))
    module = _tiny(caption_dropout=0.5)
    _attach_datamodule(module, [str(first), str(second)])
    with pytest.raises(ValueError, match="differ"):
        module.drop_captions(torch.randn(4, 6, 32))
    # the same one in both: fine
    write_empty_prompt(second, np.ones((1, 32), dtype=np.float32))
    module = _tiny(caption_dropout=0.5)
    _attach_datamodule(module, [str(first), str(second)])
    module.drop_captions(torch.randn(4, 6, 32))


def test_no_dropout_draws_nothing_and_keeps_every_caption():
    module = _tiny()
    assert module.hparams.caption_dropout == 0.0
    seen = {}
    module.transformer.register_forward_hook(
        lambda mod, args, kwargs, out: seen.update(text=kwargs["encoder_hidden_states"]), with_kwargs=True)
    batch = _batch(batch_size=4)
    torch.manual_seed(2)
    module.training_step(batch, 0)
    after = torch.rand(1)
    torch.manual_seed(2)
    torch.rand(4), torch.randn(batch["latents"].shape)
    assert torch.equal(seen["text"], batch["text"]) and torch.equal(torch.rand(1), after)


# -- loss weighting --

def test_token_weighting_against_fp64_over_two_simulated_ranks(monkeypatch):
    """Rank 0: 3 images of 4 tokens; rank 1: 1 clip of 16 tokens. Token weighting has no collective:
    the ranks' losses averaged (what DDP/FSDP do to gradients) are the sum over all 28 tokens of
    each token's mean squared error over (world_size * loss_reference_tokens)."""
    monkeypatch.setattr("examples.wan.module.scale_loss_to_global_mean",
                        lambda *a: pytest.fail("token weighting must not rescale by a count"))
    reference_tokens = 10
    module = _tiny(loss_weighting="token", loss_reference_tokens=reference_tokens)
    preds = []
    module.transformer.register_forward_hook(lambda mod, args, kwargs, out: preds.append(
        (kwargs["hidden_states"], out[0])), with_kwargs=True)
    losses, expected_sum, per_token_elements = [], 0.0, 4 * 1 * 2 * 2  # C * pt * ph * pw
    for rank, (batch_size, thw) in enumerate([(3, (1, 4, 4)), (1, (2, 4, 8))]):
        batch = _batch(batch_size=batch_size, thw=thw, seed=rank)
        torch.manual_seed(20 + rank)
        out = module.training_step(batch, 0)
        torch.manual_seed(20 + rank)
        sigma = module.sample_sigmas(batch_size, thw[1] * thw[2] // 4, "cpu").double().view(-1, 1, 1, 1, 1)
        noise = torch.randn(batch["latents"].shape).double()
        x0 = batch["latents"].double()
        pred = preds[-1][1].double()
        squared = (pred - (noise - x0)) ** 2  # (B, C, T, H, W)
        rank_sum = squared.sum().item() / per_token_elements  # sum over tokens of each token's mean
        assert out["loss"].item() == pytest.approx(rank_sum / reference_tokens, rel=1e-5)
        assert out["local_loss"].item() == pytest.approx(squared.mean().item(), rel=1e-5)  # logged: per sample
        losses.append(out["loss"])
        expected_sum += rank_sum
        assert torch.allclose(preds[-1][0].double(), (1 - sigma) * x0 + sigma * noise, atol=1e-6)
    averaged = (losses[0] + losses[1]) / 2
    assert averaged.item() == pytest.approx(expected_sum / (2 * reference_tokens), rel=1e-5)
    # per-sample weighting of the same step would give the clip 1/4 of the weight; here 16/28
    assert 16 / 28 > 1 / 4


def test_sample_weighting_rescales_by_the_sample_count_and_is_the_default(monkeypatch):
    calls = []
    monkeypatch.setattr("examples.wan.module.scale_loss_to_global_mean",
                        lambda loss, count: calls.append(count) or loss)
    module = _tiny()
    assert module.hparams.loss_weighting == "sample"
    torch.manual_seed(0)
    out = module.training_step(_batch(batch_size=3, thw=(2, 4, 4)), 0)
    assert calls == [3]
    torch.testing.assert_close(out["loss"].detach(), out["local_loss"], rtol=0, atol=0)
