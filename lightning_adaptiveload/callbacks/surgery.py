"""FusedAdaLNSurgery: apply `apply_fused_adaln` to the LightningModule in `setup()`.

`setup()` runs before `configure_model` and before the strategy (FSDP, DDP) wraps the model, so
the blocks keep their classes for auto-wrap and activation-checkpointing policies. Models built
inside `configure_model`, or in the LightningModule's own `setup` (which Lightning calls after the
callbacks'), do not exist yet at that point: call `apply_fused_adaln` at the end of that hook
instead (docs/surgery.md). Compile in `configure_model` (after this callback): docs/surgery.md,
"Compiled models".
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any, Union

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from lightning_adaptiveload.ops import ensure_extension
from lightning_adaptiveload.surgery import AdaLNPattern, SurgeryReport, apply_fused_adaln, resolve_patterns


class FusedAdaLNSurgery(Callback):
    """Swap recognised AdaLN modules for the fused op before the model is wrapped.

    patterns: names of patterns to use (default all: `surgery.PATTERN_NAMES` and extra_patterns).
    extra_patterns: your own AdaLNPatterns, as objects or import paths resolved with importlib
        (from a LightningCLI YAML: `extra_patterns: [examples.video_dit.surgery.VIDEO_DIT_PATTERNS]`);
        a path may name one pattern or a list of them.
    idioms: also rewrite recognised AdaLN idioms in modules no pattern fuses (docs/surgery.md).
    require_replacement: raise in setup() if nothing was replaced (guards against a silent no-op,
        e.g. an unchecked library version or a model built in `configure_model`).
    On CUDA, when something was fused, setup() also loads or builds the kernels
    (`ops.ensure_extension`), so no timed calibration point or training step pays for a JIT build.
    The report is kept in `self.report`, logged on rank 0 and, when the trainer has a logger,
    written to `<trainer.log_dir>/fused_adaln_surgery.json`; both again after the first training
    batch when idiom rewrites were checked on their first call (verified, or restored and why).
    """

    def __init__(
        self,
        patterns: Iterable[str] | None = None,
        extra_patterns: Sequence[Union[str, AdaLNPattern]] | None = None,
        idioms: bool = True,
        require_replacement: bool = False,
    ) -> None:
        self.patterns = None if patterns is None else list(patterns)
        self.extra_patterns = resolve_patterns(extra_patterns)  # a bad path fails here, not at fit time
        self.idioms = idioms
        self.require_replacement = require_replacement
        self.report: SurgeryReport | None = None
        self._checks_logged = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        report = apply_fused_adaln(pl_module, patterns=self.patterns, extra_patterns=self.extra_patterns, idioms=self.idioms)
        fused = report.num_replaced + sum(len(names) for names in report.already_fused.values())
        if self.require_replacement and fused == 0:
            raise RuntimeError(
                "FusedAdaLNSurgery(require_replacement=True): no AdaLN module was fused in "
                f"{type(pl_module).__name__}.\n{report}\nIf the model is built in configure_model (or the module's setup), call "
                "apply_fused_adaln there instead (docs/surgery.md)."
            )
        if self.report is None or report.num_replaced:  # keep the first report across fit/validate stages
            self.report = report
        rank_zero_info(str(report))
        if fused and trainer.strategy.root_device.type == "cuda":
            # Load or JIT-build the kernels now (with a progress line), never inside a timed
            # calibration point or the first training step.
            ensure_extension(verbose=trainer.is_global_zero)
        self._write(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._checks_logged or self.report is None or not self.report.verification:
            return
        self._checks_logged = True  # every rewritten block has run once by now (unless compiled)
        rank_zero_info(str(self.report))
        self._write(trainer)

    def _write(self, trainer: Trainer) -> None:
        log_dir = trainer.log_dir if trainer.loggers else None  # a collective: call it on every rank
        if trainer.is_global_zero and log_dir is not None and self.report is not None:
            os.makedirs(log_dir, exist_ok=True)
            with open(os.path.join(log_dir, "fused_adaln_surgery.json"), "w") as f:
                json.dump(self.report.to_dict(), f, indent=1)
