"""CompileCache: the Lightning hooks of lightning_adaptiveload.compile_cache (a torch.compile cache that
persists across runs).

Every rank loads the bundle in `setup`, which Lightning runs before `configure_model` (where the
example modules compile their blocks) and before `CostModelCalibration`'s `on_fit_start` (which runs
the first compiled steps). Rank 0 saves it in `on_train_start`, when calibration and verification
have compiled every scheduled shape, and again in `on_train_end` and `on_fit_end` for the graphs
first met in training (a save without new artifacts writes nothing). docs/lightning.md, "Compiled
training", says what this saves on the GPU.
"""
from __future__ import annotations

import os

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_adaptiveload.calibration.record import model_fingerprint
from lightning_adaptiveload.compile_cache import CompileCache as Cache
from lightning_adaptiveload.compile_cache import cache_key, read_cache_counts


class CompileCache(Callback):
    """Persist torch.compile's artifacts across runs of one config.

    directory: where the bundle, its record and (unless TORCHINDUCTOR_CACHE_DIR is set) torch's
        on-disk compile caches live; default `<trainer.default_root_dir>/compile_cache`, beside
        calibration_cache.json. Trusted like any compile cache: written by this callback only.
    compile_mode: the name of the compile mode in the bundle's key; default the module's
        `hparams["compile"]` (the example modules' `compile` argument), else None. The key also
        holds the module's fingerprint (calibration.record.model_fingerprint, which covers every
        hparam), the device and the versions of torch, CUDA and python.

    `cache` is the run's lightning_adaptiveload.compile_cache.CompileCache once `setup` ran, and
    `loaded` whether its bundle loaded there (None before).
    """

    def __init__(self, directory: str | None = None, compile_mode: str | None = None):
        self.directory = directory
        self.compile_mode = compile_mode
        self.cache: Cache | None = None
        self.loaded: bool | None = None
        self._counts_at_load: dict[str, int] | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        mode = self.compile_mode
        if mode is None:
            mode = (getattr(pl_module, "hparams", None) or {}).get("compile")
        key = cache_key(model_fingerprint(pl_module), None if mode is None else str(mode), trainer.strategy.root_device)
        self.cache = Cache(self.directory or os.path.join(trainer.default_root_dir, "compile_cache"), key,
                           info=rank_zero_info, warn=rank_zero_warn)
        self.loaded = self.cache.load()
        self._counts_at_load = read_cache_counts()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._report("before training")
        self._save(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._report("by the end of training")
        self._save(trainer)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save(trainer)

    def _report(self, when: str) -> None:
        """Rank 0's graphs read from torch's caches (the bundle or the on-disk ones) and compiled since
        `setup`."""
        counts = read_cache_counts()
        since = {name: counts[name] - self._counts_at_load.get(name, 0) for name in counts}
        rank_zero_info(f"CompileCache: {when}, {since['fxgraph_hits']} graphs read from the compile cache, "
                       f"{since['fxgraph_misses']} compiled by inductor, {since['fxgraph_bypasses']} not cacheable; "
                       f"forward/backward pairs: {since['autograd_hits']} read, {since['autograd_misses']} compiled "
                       "(rank 0, since setup)")

    def _save(self, trainer: Trainer) -> None:
        if trainer.is_global_zero and self.cache is not None:
            self.cache.save()
