"""`adaptiveload encode`: videos and images with captions -> latent shards and an index.

    grid.py      the bucket grid (pixel shapes), resolution and frame-bucket choice (no torch)
    inputs.py    listing inputs (folder, JSONL manifest, WebDataset tars), captions, bad-input reasons
    decode.py    PyAV/Pillow decoding, resampling by timestamps, resize + center crop, windows
    models.py    the Wan VAE (diffusers) and UMT5 text encoder (transformers), from local weights
    state.py     resume journal, shard checks, per-rank done markers, finalize (index)
    pipeline.py  encode_videos / finalize_encode

The optional packages (PyAV, transformers) are imported only when used: install them with
`pip install "lightning-adaptiveload[encode]"`. docs/data.md, "Encoding videos", has the details.
"""
