"""A WanTransformer3DModel from a local diffusers folder without a random init.

The model is first built on the meta device with diffusers' `no_init_weights` (shapes only: no
parameter memory, no init function touches data, no random number is drawn), then its weights come
from the folder's *.safetensors files (sharded ones through
`diffusion_pytorch_model.safetensors.index.json`), converted to fp32 (the master weights; Wan's
bf16 releases become exact fp32 values). Two ways:

- `load_full`: every tensor read whole and assigned in place of the meta one (no copy): one fp32
  model in host memory per process. What a single device, DDP and FSDP1 need (each rank holds the
  full model before FSDP1 shards it).
- `load_local_shards`: after FSDP2's `fully_shard` (of the meta model) and `to_empty`, each rank
  reads from the files only the rows of its own shard of every parameter (safetensors slices are
  memory-mapped reads of those bytes) and copies them into its local shard. Chosen over rank 0
  reading and broadcasting because no process then ever holds the whole model (14B x 8 ranks in
  fp32 would be 450 GB of host memory) and no broadcast is needed: together the ranks read the
  files once.

Pickled `.bin` weights are never read and nothing is downloaded. Checked before any tensor is read:
the files' keys and shapes against the config's model; a mismatch is a ValueError naming the folder.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

INDEX_FILE = "diffusion_pytorch_model.safetensors.index.json"


def transformer_folder(path: str) -> Path:
    """The transformer folder of `path` (itself, or a pipeline folder's `transformer/`);
    FileNotFoundError when neither holds config.json."""
    root = Path(path)
    folder = root / "transformer" if (root / "transformer" / "config.json").is_file() else root
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"WanModule: pretrained={path!r} is not a local diffusers transformer folder "
                                "(config.json + safetensors) nor a pipeline folder with transformer/config.json")
    return folder


def read_config(folder: Path) -> dict[str, Any]:
    """The folder's transformer config (config.json, diffusers' keys)."""
    from diffusers import WanTransformer3DModel

    return dict(WanTransformer3DModel.load_config(folder))


def build_empty(config: dict[str, Any]):
    """A WanTransformer3DModel of `config` (a folder's config.json or constructor arguments) on
    the meta device, no init run: parameters and buffers hold no data until loaded."""
    from diffusers import WanTransformer3DModel
    from diffusers.models.modeling_utils import no_init_weights

    with no_init_weights(), torch.device("meta"):
        return WanTransformer3DModel.from_config(config)


class SafetensorsWeights:
    """Where each tensor of a folder's safetensors lives, and its shape, read from the files'
    headers only. FileNotFoundError when the folder has no safetensors (or its index names a
    missing file)."""

    def __init__(self, folder: Path, path: str):
        from safetensors import safe_open

        self.folder, self.path = folder, path
        index = folder / INDEX_FILE
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [folder / name for name in names]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"WanModule: pretrained={path!r}: {INDEX_FILE} names files that are not "
                                        f"in {folder}: {missing[:3]}")
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"WanModule: pretrained={path!r}: no *.safetensors weights in {folder} "
                                    "(pickled .bin weights are not loaded; convert them to safetensors)")
        self.file_of: dict[str, Path] = {}
        self.shape_of: dict[str, tuple[int, ...]] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    self.file_of[key] = file
                    self.shape_of[key] = tuple(handle.get_slice(key).get_shape())

    def check_against(self, model) -> None:
        """ValueError naming the folder unless the files hold exactly the model's state_dict keys
        (less the ones diffusers ignores on load) with the model's shapes."""
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        ignored = type(model)._keys_to_ignore_on_load_unexpected or []
        missing = sorted(set(expected) - set(self.file_of))
        unexpected = sorted(k for k in set(self.file_of) - set(expected) if not any(p in k for p in ignored))
        shapes = [f"{k}: {self.shape_of[k]} in the files, {shape} in the config"
                  for k, shape in expected.items() if k in self.shape_of and self.shape_of[k] != shape]
        if missing or unexpected or shapes:
            raise ValueError(f"WanModule: pretrained={self.path!r}: the weights in {self.folder} do not match its "
                             f"config.json: missing {_few(missing)}, unexpected {_few(unexpected)}, "
                             f"other shape {_few(shapes)}")


def _few(items: list[str]) -> list[str] | str:
    return items[:5] + ["..."] if len(items) > 5 else items


def _master(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.is_floating_point() else tensor


def load_full(model, weights: SafetensorsWeights) -> None:
    """Give the meta `model` every weight, whole, as fp32 CPU tensors (assigned, not copied), and
    its recomputed non-persistent buffers (`rebuild_buffers`)."""
    from safetensors.torch import load_file

    weights.check_against(model)
    state: dict[str, torch.Tensor] = {}
    for file in dict.fromkeys(weights.file_of.values()):
        state.update({k: _master(v) for k, v in load_file(file).items() if k in model.state_dict()})
    model.load_state_dict(state, strict=True, assign=True)
    rebuild_buffers(model, torch.device("cpu"))


def read_rows(file: Path, key: str, index: tuple[slice, ...]) -> torch.Tensor:
    """tensor[index] of `key` in `file`, reading only those bytes (a safetensors slice)."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        return handle.get_slice(key)[index]


def load_local_shards(model, weights: SafetensorsWeights) -> None:
    """Fill an FSDP2-sharded model (`fully_shard` applied on the meta device, then `to_empty`)
    with each rank's own part of every weight, read alone from the files (module docstring).
    Parameters that are not DTensors (none under `fully_shard`) are read whole."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    weights.check_against(model)
    device = None
    with torch.no_grad():
        for name, param in model.named_parameters():
            file = weights.file_of[name]
            if isinstance(param, DTensor):
                shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                                      param.placements)
                local = param.to_local()
                if local.numel():
                    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
                    local.copy_(read_rows(file, name, index))
            else:
                param.copy_(read_rows(file, name, tuple(slice(None) for _ in param.shape)))
            device = param.device
    rebuild_buffers(model, device or torch.device("cpu"))


def rebuild_buffers(model, device: torch.device) -> None:
    """Recompute what the weights files do not hold: the RoPE tables (non-persistent buffers, no
    randomness), as diffusers' constructor computes them, on `device`. RuntimeError if any other
    tensor is left without data."""
    config = model.config
    fresh = type(model.rope)(config["attention_head_dim"], tuple(config["patch_size"]), config["rope_max_seq_len"])
    for name, buffer in fresh.named_buffers():
        setattr(model.rope, name, buffer.to(device))
    empty = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if empty:
        raise RuntimeError(f"WanModule: {empty[:5]} hold no data after loading the pretrained weights")


def load_pretrained_transformer(path: str):
    """A WanTransformer3DModel from the local folder `path` (a transformer folder or a diffusers
    pipeline folder holding one under `transformer/`): built empty, then `load_full`; fp32, on the
    CPU. Loaded here rather than with diffusers' `from_pretrained`, which for Wan (fp32-kept modules)
    requires `accelerate`. FileNotFoundError for a folder without config.json or safetensors,
    ValueError for weights that do not match the config (missing, unexpected or other-shaped keys)."""
    folder = transformer_folder(path)
    weights = SafetensorsWeights(folder, path)
    model = build_empty(read_config(folder))
    load_full(model, weights)
    return model
