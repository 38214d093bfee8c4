"""Example Wan-2.1-style video DiT: network (model.py) and LightningModule (module.py)."""
