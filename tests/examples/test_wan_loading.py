"""examples/wan/loading.py through WanModule(pretrained=...): no random init runs (no init
function touches a real tensor, the RNG is not drawn from), the loaded weights are bit-exact (from
fp32 and from bf16 files, one file or sharded with an index), and the errors name the folder. FSDP2's
per-rank reads: test_wan_fsdp2.py."""
import json

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from examples.wan.loading import load_pretrained_transformer  # noqa: E402
from examples.wan.module import WanModule  # noqa: E402

TINY = dict(num_layers=2, num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32,
            freq_dim=32, ffn_dim=64)

pytestmark = pytest.mark.usefixtures("one_thread")


def _reference(**overrides):
    torch.manual_seed(0)
    return diffusers.WanTransformer3DModel(**{**TINY, **overrides})


def _guard_inits(monkeypatch):
    """Every reset_parameters of a torch module and every torch.nn.init function fails on a tensor
    with data: only shapes (meta tensors) may pass through them."""
    def guarded(original):
        def check(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            owner = args[0] if args and isinstance(args[0], torch.nn.Module) else None
            if owner is not None:
                tensors += list(owner.parameters(recurse=False))
            if any(not t.is_meta for t in tensors):
                raise AssertionError(f"a random init ran on real memory: {original.__qualname__}")
            return original(*args, **kwargs)
        return check

    for cls in (torch.nn.Linear, torch.nn.Conv3d, torch.nn.LayerNorm, torch.nn.RMSNorm):
        monkeypatch.setattr(cls, "reset_parameters", guarded(cls.reset_parameters))
    for name in ("uniform_", "normal_", "kaiming_uniform_", "xavier_uniform_", "trunc_normal_", "zeros_", "ones_"):
        monkeypatch.setattr(torch.nn.init, name, guarded(getattr(torch.nn.init, name)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pretrained_loads_bit_exact_weights_without_a_random_init(tmp_path, monkeypatch, dtype):
    reference = _reference().to(dtype)  # diffusers warns: the test casts what it keeps in fp32 too
    reference.save_pretrained(tmp_path / "pipeline" / "transformer")  # safetensors by default
    with monkeypatch.context() as guard:
        _guard_inits(guard)
        with pytest.raises(AssertionError, match="a random init ran"):  # the guard sees a plain build
            _reference()
        rng = torch.get_rng_state()
        module = WanModule(pretrained=str(tmp_path / "pipeline"))  # a pipeline folder: its transformer/
        assert all(p.is_meta for p in module.parameters())  # __init__ builds shapes only
        module.configure_model()  # outside a Trainer: read the weights
        assert torch.equal(torch.get_rng_state(), rng)  # nothing drew a random number
    loaded, expected = module.transformer.state_dict(), reference.state_dict()
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert loaded[key].dtype == torch.float32, key  # fp32 master weights, bf16 files exactly widened
        assert torch.equal(loaded[key], value.float()), key
    assert all(p.requires_grad and not p.is_meta for p in module.parameters())
    # the RoPE tables (not in the files) recomputed as diffusers computes them
    for name, buffer in _reference().rope.named_buffers():  # (`reference` was cast whole)
        assert torch.equal(getattr(module.transformer.rope, name), buffer), name
    module.configure_model()  # again: nothing read twice, nothing changed
    assert all(torch.equal(module.transformer.state_dict()[k], v.float()) for k, v in expected.items())


def test_pretrained_trains_and_follows_the_folders_config(tmp_path):
    _reference(in_channels=6, out_channels=6).save_pretrained(tmp_path / "six")
    module = WanModule(pretrained=str(tmp_path / "six"))
    module.log = lambda *args, **kw: None
    module.configure_model()
    batch = {"latents": torch.randn(1, 6, 1, 4, 4), "text": torch.randn(1, 5, 32)}
    out = module.training_step(batch, 0)
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and all(p.grad is not None for p in module.parameters())
    with pytest.raises(ValueError, match=r"must be \(B, 6, T, H, W\)"):
        module.training_step({"latents": torch.randn(1, 4, 1, 4, 4), "text": torch.randn(1, 5, 32)}, 0)


def test_sharded_files_load_through_their_index(tmp_path):
    reference = _reference()
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    model = load_pretrained_transformer(str(tmp_path / "sharded"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in reference.state_dict().items())
    index = tmp_path / "sharded" / "diffusion_pytorch_model.safetensors.index.json"
    weight_map = json.loads(index.read_text())
    first = sorted(set(weight_map["weight_map"].values()))[0]
    (tmp_path / "sharded" / first).unlink()
    with pytest.raises(FileNotFoundError, match="names files that are not in"):
        load_pretrained_transformer(str(tmp_path / "sharded"))


def test_wrong_folders_raise_errors_naming_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local diffusers transformer folder"):
        WanModule(pretrained=str(tmp_path / "missing"))
    pickled = tmp_path / "pickled"
    _reference().save_pretrained(pickled, safe_serialization=False)  # diffusion_pytorch_model.bin
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        WanModule(pretrained=str(pickled))
    config = (pickled / "config.json").read_text()
    # more blocks in the files than in the config: unexpected keys, named
    extra = tmp_path / "extra"
    _reference(num_layers=3).save_pretrained(extra)
    (extra / "config.json").write_text(config)
    with pytest.raises(ValueError, match=f"weights in {extra} do not match.*unexpected \\['blocks.2"):
        WanModule(pretrained=str(extra))
    # another width: the shape mismatch is the documented ValueError, not torch's "size mismatch"
    wide = tmp_path / "wide"
    _reference(ffn_dim=96).save_pretrained(wide)
    (wide / "config.json").write_text(config)
    with pytest.raises(ValueError, match=f"weights in {wide} do not match.*"
                                         r"blocks.0.ffn.net.0.proj.weight: \(96, 32\) in the files, \(64, 32\)"):
        WanModule(pretrained=str(wide))
    with pytest.raises(ValueError, match="weights in .* do not match"):
        load_pretrained_transformer(str(wide))
    with pytest.raises(ValueError, match="not both"):
        WanModule(pretrained=str(extra), transformer_config={"num_layers": 1})
    with pytest.raises(ValueError, match="text-to-video Wan: in_channels == out_channels"):
        WanModule(transformer_config={**TINY, "in_channels": 36})
