"""lightning-adaptiveload: load-balanced bucketing, a cost model calibrated on your training step,
per-rank imbalance monitoring and a fused AdaLN CUDA kernel for video DiT training under PyTorch
Lightning.

    import lightning_adaptiveload as la
    trainer = L.Trainer(strategy="fsdp", use_distributed_sampler=False,
                        callbacks=[la.FusedAdaLNSurgery(), la.CostModelCalibration(), la.LoadBalanceMonitor()])
    trainer.fit(module, datamodule=la.AdaptiveLoadDataModule(shards=..., index=..., m_mem=65536))

Every public name is imported on first use (PEP 562), so `import lightning_adaptiveload` and the
`adaptiveload` command's `--help` load neither torch nor Lightning.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it; docs/architecture.md shows the layers they come from
_EXPORTS = {
    # scheduling core (numpy only)
    "TokenSpec": "scheduling.shapes",
    "ShapeMix": "scheduling.shapes",
    "read_shapes_jsonl": "scheduling.shapes",
    "token_equal_batch_size": "scheduling.policies",
    "dual_constraint_batch_size": "scheduling.policies",
    "batch_sizes": "scheduling.policies",
    "CostModel": "scheduling.cost_model",
    "load_cost_model": "scheduling.cost_model",
    "BucketTable": "scheduling.buckets",
    "EpochPlan": "scheduling.epoch_plan",
    "BucketBatchSampler": "scheduling.sampler",
    "StreamingBucketBatcher": "scheduling.stream_batcher",
    "simulate": "scheduling.simulate",
    # data
    "AdaptiveLoadDataModule": "data.datamodule",
    "build_index": "data.index",
    "read_index": "data.index",
    "write_synthetic_shards": "data.shards",
    # encoding videos into shards (optional deps: the [encode] extra)
    "encode_videos": "encode.pipeline",
    "finalize_encode": "encode.pipeline",
    # training helpers and callbacks
    "prepare_environment": "_environment",
    "scale_loss_to_global_mean": "loss",
    "FSDPNormClipping": "clipping",
    "CostModelCalibration": "callbacks.calibration",
    "LoadBalanceMonitor": "callbacks.monitor",
    "FusedAdaLNSurgery": "callbacks.surgery",
    "AttentionBackends": "callbacks.attention",
    # fused AdaLN: op, module, surgery
    "adaln_modulate": "ops.adaln",
    "ensure_extension": "ops.extension",
    "FusedAdaLN": "ops.modules",
    "apply_fused_adaln": "surgery",
    "register_adaln_patterns": "surgery",
    "AdaLNPattern": "surgery",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_adaptiveload' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
