"""Training diffusers' Wan 2.1 transformer (`WanTransformer3DModel`) with the suite: `module.py`."""
