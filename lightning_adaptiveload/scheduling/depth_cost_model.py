"""DepthCostModel: step time t(B, S, k) when k of the model's L switchable blocks run under
activation checkpointing, built around a CostModel fitted at k = L (docs/memory.md, "Step time with a
depth k")."""
from __future__ import annotations

import numpy as np

from lightning_adaptiveload._validation import is_finite_number, require_int
from lightning_adaptiveload.scheduling.cost_model import CostModel, model_from_doc
from lightning_adaptiveload.scheduling.fitting import check_checkpointed, check_measurements, rel_err
from lightning_adaptiveload.scheduling.model_io import (JsonDocument, check_header, check_json_int, check_quality,
                                                        nan_to_none)

DEPTH_FORMAT = "adaptiveload.depth_cost_model"
DEPTH_VERSION = 1
DEPTH_QUALITY_KEYS = ("mean_rel_err", "max_rel_err", "heldout_mean_rel_err", "heldout_max_rel_err")


def _recompute_fraction(u: np.ndarray, ratio: np.ndarray) -> float:
    """g minimising sum(((1 - g*u) - ratio) / ratio)^2), clipped to [0, 1]."""
    w2 = 1.0 / ratio**2
    return float(np.clip(np.sum(w2 * u * (1.0 - ratio)) / np.sum(w2 * u * u), 0.0, 1.0))


class DepthCostModel(JsonDocument):
    """Step time t(B, S, k) ms when k of the model's L switchable blocks are checkpointed:

        t(B, S, k) = t_L(B, S) * (1 - g * (L - k) / L)

    t_L is a CostModel fitted at full checkpointing (k = L: what every step runs unless told
    otherwise, and the depth every shape fits at). Recomputing a checkpointed block in backward costs
    about one more forward of it; with a forward ~1/3 of forward + backward, recomputing all L
    blocks is ~1/4 of a fully checkpointed step, so g (the share of a fully checkpointed step that
    recomputation takes) is about 0.25 (one H200, Wan-1.3B shape: 30 -> 20 checkpointed blocks
    saved 7.5-8.8%, g = 0.23-0.26). g is fitted to the ratio t(B, S, k) / t(B, S, L) of steps
    measured at the same (B, S) at both depths, not to t_L's prediction, whose error (~5%) would
    swamp an effect this small. Users of CostModel that know no k are unaffected: `base` is that
    CostModel, and predict(B, S) (k = L) equals it.
    """

    def __init__(self, base: CostModel, num_blocks: int, recompute_fraction: float, quality: dict | None = None):
        if not isinstance(base, CostModel):
            raise ValueError(f"base must be a CostModel, got {type(base).__name__}")
        num_blocks = require_int("num_blocks", num_blocks)
        if not is_finite_number(recompute_fraction) or not 0 <= recompute_fraction <= 1:
            raise ValueError(f"recompute_fraction must be a number in [0, 1], got {recompute_fraction!r}")
        self.base = base
        self.num_blocks = num_blocks
        self.recompute_fraction = float(recompute_fraction)
        # relative error of t(B, S, k) / t(B, S, L) on the paired points (NaN where unknown)
        self.quality = {key: float((quality or {}).get(key, float("nan"))) for key in DEPTH_QUALITY_KEYS}

    def __repr__(self) -> str:
        return f"DepthCostModel({self.base!r}, num_blocks={self.num_blocks}, g={self.recompute_fraction:.4g})"

    @classmethod
    def fit(cls, batch_sizes, seq_lens, checkpointed, times_ms, num_blocks: int,
            form: str = "auto", base: CostModel | None = None) -> "DepthCostModel":
        """Fit t_L (CostModel.fit with `form`) to the points at k = num_blocks and g to every point
        at k < num_blocks over its partner: the median time of the points at k = num_blocks of the
        same (B, S) where there are some, else t_L's prediction (verification measures shapes at
        depths and batch sizes calibration did not pair; at k = 0 the recomputation saved is ~25% of
        the step, several times t_L's error). 1-D arrays of equal length.
        base: a CostModel already fitted to the points at k = num_blocks (e.g. by calibration, which
        judges it first); given, t_L is not fitted again and `form` is unused."""
        b, s, t = check_measurements(batch_sizes, seq_lens, times_ms)
        num_blocks = require_int("num_blocks", num_blocks)
        k = check_checkpointed(checkpointed, num_blocks)
        if k.shape != t.shape:
            raise ValueError(f"checkpointed must have the shape of times_ms {t.shape}, got {k.shape}")
        full = k == num_blocks
        if base is None:
            base = CostModel.fit(b[full], s[full], t[full], form=form)
        partner = {}
        for bi, si, ti in zip(b[full], s[full], t[full]):
            partner.setdefault((bi, si), []).append(ti)
        if not np.any(~full):
            raise ValueError(f"the recompute fraction needs points at k < {num_blocks}; "
                             f"all points have k = {num_blocks}")
        u = (num_blocks - k[~full]) / num_blocks
        ratio = t[~full] / np.array([np.median(partner[(bi, si)]) if (bi, si) in partner else float(base.predict(bi, si))
                                     for bi, si in zip(b[~full], s[~full])])
        g = _recompute_fraction(u, ratio)
        rel = rel_err(1.0 - g * u, ratio)
        heldout = np.full(len(u), np.nan)
        if len(u) > 1:
            for i in range(len(u)):
                keep = np.arange(len(u)) != i
                heldout[i] = rel_err(1.0 - _recompute_fraction(u[keep], ratio[keep]) * u[i], ratio[i])
        quality = {"mean_rel_err": float(rel.mean()), "max_rel_err": float(rel.max()),
                   "heldout_mean_rel_err": float(heldout.mean()), "heldout_max_rel_err": float(heldout.max())}
        return cls(base, num_blocks, g, quality)

    def predict(self, batch_size, seq_len, checkpointed=None):
        """Step time in ms; checkpointed=None means k = L (the base model's time). Scalars give a
        float, arrays broadcast and give an array."""
        t = self.base.predict(batch_size, seq_len)
        if checkpointed is None:
            return t
        u = (self.num_blocks - check_checkpointed(checkpointed, self.num_blocks)) / self.num_blocks
        t = np.asarray(t) * (1.0 - self.recompute_fraction * u)
        return float(t) if np.ndim(t) == 0 else t

    def to_dict(self) -> dict:
        """The model as a JSON-ready dict (the document to_json writes): the base CostModel's
        document under "base"."""
        return {
            "format": DEPTH_FORMAT,
            "version": DEPTH_VERSION,
            "num_blocks": self.num_blocks,
            "recompute_fraction": self.recompute_fraction,
            "quality": nan_to_none(self.quality),
            "base": self.base.to_dict(),
        }

    @classmethod
    def from_dict(cls, doc, where: str = "depth cost model") -> "DepthCostModel":
        """The model of a `to_dict` document; ValueError naming `where` for anything malformed."""
        check_header(doc, where, DEPTH_FORMAT, DEPTH_VERSION, ("num_blocks", "recompute_fraction", "quality", "base"))
        num_blocks = check_json_int(doc, "num_blocks", where, minimum=1)
        g = doc["recompute_fraction"]
        if not is_finite_number(g) or not 0 <= g <= 1:
            raise ValueError(f"{where}: 'recompute_fraction' must be a number in [0, 1], got {g!r}")
        quality = check_quality(doc["quality"], DEPTH_QUALITY_KEYS, where)
        return cls(model_from_doc(doc["base"], f"{where}: 'base'"), num_blocks, g, quality)
