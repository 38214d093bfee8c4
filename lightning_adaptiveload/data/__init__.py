"""WebDataset shards of video latents: sample format, index, and the Lightning DataModule.

The shipped `*.jsonl` / `*.json` files next to this module are example inputs
(`reference_mix.jsonl`: a shape histogram; `h200_dit_cost_curve.json`: measured step times;
`h200_ac_measurements.json`: step times and peak memory at two checkpointing depths).
"""
from lightning_adaptiveload.data.index import SampleIndex, build_index, read_index
from lightning_adaptiveload.data.shards import (SKIP_REASONS, BadSample, decode_sample, encode_sample,
                                                write_shard, write_synthetic_shards)

__all__ = ["SKIP_REASONS", "BadSample", "SampleIndex", "build_index", "decode_sample", "encode_sample", "read_index",
           "write_shard", "write_synthetic_shards"]
