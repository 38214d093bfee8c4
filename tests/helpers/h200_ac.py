"""Activation-checkpointing measurements on one H200 (2026-12-01), copied here as test data from the
project's shared measurements (shared/data/h200_2026-12-01/ac_lever.json and selective_ac.json): the
example Wan-1.3B-shaped DiT (examples/video_dit), all 30 blocks, bf16 autocast, AdamW, no sharding,
token-equal batches at m_mem 65,536."""

NUM_BLOCKS = 30

# (B, S, k, step ms, peak GiB); k = blocks under activation checkpointing. ac_lever.json (k = 30), then
# selective_ac.json (k = 30 and 20 at three of the same shapes).
H200_AC = [
    (256, 256, 30, 3397.2109510000055, 38.509066104888916),
    (64, 1024, 30, 3039.2582869999956, 33.419893741607666),
    (18, 3600, 30, 3173.538620000002, 32.03029823303223),
    (8, 7800, 30, 3411.878262000002, 31.19760751724243),
    (3, 20280, 30, 4410.574165999975, 30.69887113571167),
    (2, 32760, 30, 5980.911937999991, 31.79890203475952),
    (1, 46800, 30, 5301.002914000009, 28.43356704711914),
    (1, 75600, 30, 11649.725528000004, 34.21213912963867),
    (64, 1024, 30, 3044.121111000038, 33.421846866607666),
    (64, 1024, 20, 2775.3542519999996, 120.18978309631348),
    (3, 20280, 30, 4417.853451999974, 30.698503971099854),
    (3, 20280, 20, 4061.056223000037, 107.0174913406372),
    (1, 46800, 30, 5273.572586, 28.434627532958984),
    (1, 46800, 20, 4877.435658999957, 86.51118755340576),
]

# (B, S, k) that ran out of memory: k = 10 and 0 in selective_ac.json, k = 0 at every ac_lever.json shape
H200_OOM = [(64, 1024, 10), (3, 20280, 10), (1, 46800, 10), (64, 1024, 0), (3, 20280, 0), (1, 46800, 0),
            (256, 256, 0), (18, 3600, 0), (8, 7800, 0), (2, 32760, 0), (1, 75600, 0)]
