"""Peak device memory of a training step, peak(B, S, k) in bytes, fitted to measurements.

B is the batch size (samples), S the tokens per sample, k how many of the model's L switchable
blocks run under activation checkpointing (AC) in the step (lightning_adaptiveload.checkpointing:
the first k blocks in registration order are checkpointed, the last L - k keep their
activations). With u = L - k un-checkpointed blocks and n = max(u, 1) blocks' activations live at
the peak (n = u = 0 when L = 0):

    peak = m0 + B * (c + a*S [+ q*S^2]) + n * B * (c_k + b*S [+ q_k*S^2])

Why max(u, 1): backward recomputes a checkpointed block's forward and holds its activations
while it runs, as if that block were not checkpointed. With k = L that one block is the peak's;
with 0 < k < L the checkpointed (first) blocks are recomputed only after the u later blocks'
backward has freed their activations, so the peak holds u blocks (the same single block when
u = 1: checkpointing the last block saves no memory, only time). A fit linear in u itself (the
version-1 model) reads L/2 - 1 blocks' growth between k = L and k = L // 2 as L/2 blocks', and
predicted an H200's k = 0 peaks 6-12% low (benchmarks/results/memory_plan_h200_v1model.json).

- m0: what no batch changes: parameters, gradients, optimizer state and the optimizer step's
  temporaries, allocator workspace.
- c, a: memory of a fully checkpointed step per sample and per token beyond the one block live
  in backward: every checkpointed block's saved input (B, S, D), the layers outside the blocks
  (patch embedding, head, loss). c is what a sample holds whatever its length (text
  conditioning: the prompt's embeddings and cross-attention K/V, modulation vectors).
- c_k, b: one live block's activations per sample and per token (beyond the input a
  checkpointed block keeps). Each block of a DiT has the same shape, so the term is linear in n.
- q, q_k (form "quadratic" only): memory growing with S^2, the attention probabilities that the
  math SDPA kernel keeps for backward (CPU, or attention without a fused kernel). Flash and cuDNN
  attention keep O(S) statistics only, so on a GPU the "linear" form is expected to win.

All parameters are >= 0. The model is linear in them, so the fit is a non-negative least squares
of the relative error (residuals (pred - peak) / peak), deterministic and without starting
points. Held-out error is cross-validated like CostModel's (leave-one-out up to 64 points, else 16
folds; see fitting.folds), and form="auto" picks the form with the lowest held-out mean error
(ties: "linear").

The per-block terms need measurements at two or more depths k (e.g. k = L and k = L // 2); a
model with L = 0 (no switchable blocks) has none and is fitted at k = 0.
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import nnls

from lightning_adaptiveload.scheduling.fitting import QUALITY_KEYS, check_checkpointed, fit_quality, folds, positive_1d, rel_err
from lightning_adaptiveload.scheduling.model_io import (JsonDocument, check_form, check_header, check_json_int,
                                                        check_params, check_quality, nan_to_none)
from lightning_adaptiveload._validation import require_choice, require_int

FORMAT = "adaptiveload.memory_model"
VERSION = 2  # 2: the block term counts max(u, 1) live blocks (1: u)
FORMS = ("linear", "quadratic")  # "auto" prefers the earlier form on ties
PARAM_NAMES = {
    "linear": ("m0", "c", "a", "c_k", "b"),
    "quadratic": ("m0", "c", "a", "q", "c_k", "b", "q_k"),
}
BLOCK_PARAMS = ("c_k", "b", "q_k")  # the per-un-checkpointed-block terms (not fitted when L = 0)
NO_BOUND = 2**62  # max_batch_size where memory does not grow with B


def _peak(params: dict, b: np.ndarray, s: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The documented form at n live blocks; absent parameters (q, q_k in "linear") are 0."""
    get = params.get
    per_sample = get("c", 0.0) + s * (get("a", 0.0) + s * get("q", 0.0))
    per_block = get("c_k", 0.0) + s * (get("b", 0.0) + s * get("q_k", 0.0))
    return get("m0", 0.0) + b * (per_sample + n * per_block)


def _live_blocks(num_blocks: int, checkpointed) -> np.ndarray:
    """n = max(L - k, 1) blocks' activations live at the peak (0 when L = 0); see the module docstring."""
    unsaved = num_blocks - np.asarray(checkpointed, dtype=np.float64)
    return np.maximum(unsaved, 1.0) if num_blocks else unsaved


def _design(names: tuple[str, ...], b: np.ndarray, s: np.ndarray, n: np.ndarray) -> np.ndarray:
    """(n, len(names)) columns: peak = design @ coefficients."""
    columns = {"m0": np.ones_like(b), "c": b, "a": b * s, "q": b * s * s,
               "c_k": n * b, "b": n * b * s, "q_k": n * b * s * s}
    return np.stack([columns[name] for name in names], axis=1)


def _nnls(names: tuple[str, ...], b, s, n, peak) -> dict:
    """Non-negative least squares of the relative error; columns scaled to 1 for conditioning."""
    design = _design(names, b, s, n) / peak[:, None]
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    coef = nnls(design / scale, np.ones_like(peak), maxiter=50 * len(names))[0] / scale
    return dict(zip(names, (float(v) for v in coef)))


def _fitted_names(form: str, num_blocks: int) -> tuple[str, ...]:
    names = PARAM_NAMES[form]
    return names if num_blocks else tuple(n for n in names if n not in BLOCK_PARAMS)


def _fit_form(form: str, num_blocks: int, b, s, n, peak) -> tuple[dict, dict]:
    """(params, quality) of one form; params has every name of the form (0 where not fitted)."""
    names = _fitted_names(form, num_blocks)
    fitted = _nnls(names, b, s, n, peak)
    params = {name: fitted.get(name, 0.0) for name in PARAM_NAMES[form]}
    heldout = np.empty_like(peak)
    for idx in folds(len(peak), b, s):
        keep = np.ones(len(peak), dtype=bool)
        keep[idx] = False
        fold = _nnls(names, b[keep], s[keep], n[keep], peak[keep])
        heldout[idx] = rel_err(_peak(fold, b[idx], s[idx], n[idx]), peak[idx])
    return params, fit_quality(_peak(params, b, s, n), peak, heldout)


def _check_measurements(batch_sizes, seq_lens, checkpointed, peak_bytes, num_blocks):
    b, s, peak = (positive_1d(name, values) for name, values in
                  (("batch_sizes", batch_sizes), ("seq_lens", seq_lens), ("peak_bytes", peak_bytes)))
    k = check_checkpointed(checkpointed, num_blocks)
    if k.ndim != 1 or not len(b) == len(s) == len(k) == len(peak):
        raise ValueError(f"batch_sizes, seq_lens, checkpointed, peak_bytes must be 1-D of equal length, got "
                         f"{len(b)}, {len(s)}, {k.shape}, {len(peak)}")
    depths = np.unique(k)
    if num_blocks and len(depths) < 2:
        raise ValueError(f"the per-block terms need peaks at >= 2 checkpointing depths (e.g. k = {num_blocks} and "
                         f"k = {num_blocks // 2}); got only k = {depths.astype(int).tolist()}")
    return b, s, k, peak


class MemoryModel(JsonDocument):
    """A fitted peak-memory model peak(B, S, k) in bytes. See the module docstring for the form."""

    def __init__(self, form: str, params: dict, num_blocks: int, quality: dict | None = None,
                 candidates: dict | None = None):
        require_choice("form", form, FORMS)
        check_params(params, PARAM_NAMES[form], form, "MemoryModel")
        self.form = form
        self.num_blocks = require_int("num_blocks", num_blocks, minimum=0)
        self.params = {name: float(params[name]) for name in PARAM_NAMES[form]}
        self.quality = {key: float((quality or {}).get(key, float("nan"))) for key in QUALITY_KEYS}
        self.candidates = candidates or {}  # form -> {"params", "quality"} of every form fitted

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v:.4g}" for k, v in self.params.items())
        return f"MemoryModel(form={self.form!r}, num_blocks={self.num_blocks}, {params})"

    @classmethod
    def fit(cls, batch_sizes, seq_lens, checkpointed, peak_bytes, num_blocks: int,
            form: str = "auto") -> "MemoryModel":
        """Fit to measured peaks: 1-D arrays of equal length; B, S, peak > 0; checkpointed k whole
        numbers in [0, num_blocks], at >= 2 distinct depths when num_blocks > 0.

        form: one of FORMS, or "auto" for the lowest cross-validated mean relative error. Each form
        needs at least (its fitted parameter count + 2) points, so every held-out fold still has
        more points than parameters."""
        num_blocks = require_int("num_blocks", num_blocks, minimum=0)
        b, s, k, peak = _check_measurements(batch_sizes, seq_lens, checkpointed, peak_bytes, num_blocks)
        require_choice("form", form, ("auto", *FORMS))
        wanted = [f for f in FORMS if form in ("auto", f)]
        enough = [f for f in wanted if len(peak) >= len(_fitted_names(f, num_blocks)) + 2]
        if not enough:
            need = min(len(_fitted_names(f, num_blocks)) + 2 for f in wanted)
            raise ValueError(f"need at least {need} measurements to fit form {form!r}, got {len(peak)}")
        n = _live_blocks(num_blocks, k)
        candidates = {}
        for f in enough:
            params, quality = _fit_form(f, num_blocks, b, s, n, peak)
            candidates[f] = {"params": params, "quality": quality}
        chosen = min(candidates, key=lambda f: (candidates[f]["quality"]["heldout_mean_rel_err"], FORMS.index(f)))
        return cls(chosen, candidates[chosen]["params"], num_blocks, candidates[chosen]["quality"], candidates)

    def _live(self, checkpointed) -> np.ndarray:
        """Live blocks n at depth k; checkpointed=None means k = L."""
        k = self.num_blocks if checkpointed is None else check_checkpointed(checkpointed, self.num_blocks)
        return _live_blocks(self.num_blocks, k)

    def predict(self, batch_size, seq_len, checkpointed=None):
        """Peak bytes; checkpointed=None means every block checkpointed (k = L, the runtime's
        default). Scalars give a float, arrays broadcast and give an array."""
        b = np.asarray(batch_size, dtype=np.float64)
        s = np.asarray(seq_len, dtype=np.float64)
        peak = _peak(self.params, b, s, self._live(checkpointed))
        return float(peak) if np.ndim(peak) == 0 else peak

    def _per_block(self, b: np.ndarray, s: np.ndarray) -> np.ndarray:
        """Bytes one more live block adds at (B, S)."""
        return _peak(self.params, b, s, 1.0) - _peak(self.params, b, s, 0.0)

    def min_checkpointed(self, batch_size, seq_len, budget_bytes: float) -> tuple[np.ndarray, np.ndarray]:
        """(k, fits): the fewest checkpointed blocks whose predicted peak is <= budget_bytes, as int64
        arrays broadcast over batch_size and seq_len, and whether (B, S) fits at all (at k = L;
        k = L where it does not). Closed form, since the peak is linear in the live blocks n; k = L - 1
        costs no more memory than k = L (n = 1 both), so a fitting (B, S) gets k <= L - 1."""
        b, s = np.broadcast_arrays(np.asarray(batch_size, dtype=np.float64), np.asarray(seq_len, dtype=np.float64))
        L = self.num_blocks
        full = self.predict(b, s)  # k = L
        per_block = self._per_block(b, s)
        fits = full <= budget_bytes
        with np.errstate(divide="ignore", invalid="ignore"):
            # live blocks affordable: those of k = L, plus what the budget's rest pays for
            live = np.where(per_block > 0, _live_blocks(L, L) + np.floor((budget_bytes - full) / per_block), L)
        k = (L - np.clip(np.where(fits, live, 0), 0, L)).astype(np.int64)
        # float rounding of the quotient can overshoot by one block: take it back where it does
        k = np.minimum(k + (self.predict(b, s, k) > budget_bytes), L)
        return k, fits

    def max_batch_size(self, seq_len, budget_bytes: float, checkpointed=None) -> np.ndarray:
        """Largest B whose predicted peak at (B, S, k) is <= budget_bytes, int64 broadcast over
        seq_len and checkpointed: 0 where not even B = 1 fits, NO_BOUND where the model predicts no
        memory per sample (then memory sets no bound on B)."""
        s = np.asarray(seq_len, dtype=np.float64)
        n = self._live(checkpointed)
        fixed = _peak(self.params, 0.0, s, n)
        per_sample = _peak(self.params, 1.0, s, n) - fixed
        with np.errstate(divide="ignore", invalid="ignore"):
            b = np.clip(np.floor((budget_bytes - fixed) / per_sample), 0.0, float(NO_BOUND))
        b = np.where(per_sample > 0, b - (_peak(self.params, b, s, n) > budget_bytes) * (b > 0),  # float rounding
                     np.where(fixed <= budget_bytes, float(NO_BOUND), 0.0))
        return np.asarray(b).astype(np.int64)

    def max_seq_len(self, budget_bytes: float, batch_size: int = 1, checkpointed=None) -> int:
        """Largest S whose predicted peak at (batch_size, S, k) is <= budget_bytes (the peak grows with
        S: every parameter is >= 0); 0 where not even S = 1 fits, NO_BOUND where the peak does not
        grow with S. checkpointed=None means k = L."""
        n = float(self._live(checkpointed))
        b = float(batch_size)
        get = self.params.get
        const = _peak(self.params, b, 0.0, n)
        lin = b * (get("a", 0.0) + n * get("b", 0.0))
        quad = b * (get("q", 0.0) + n * get("q_k", 0.0))
        spare = float(budget_bytes) - const
        if spare < 0:
            return 0
        if quad > 0:
            s = (-lin + np.sqrt(lin * lin + 4.0 * quad * spare)) / (2.0 * quad)
        elif lin > 0:
            s = spare / lin
        else:
            return NO_BOUND
        s = int(min(np.floor(s), NO_BOUND))
        # the root's float rounding can be one off either way
        if s > 0 and self.predict(b, s, checkpointed) > budget_bytes:
            s -= 1
        elif s < NO_BOUND and self.predict(b, s + 1, checkpointed) <= budget_bytes:
            s += 1
        return max(s, 0)

    def to_dict(self) -> dict:
        """The model as a JSON-ready dict (the document to_json writes)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "form": self.form,
            "num_blocks": self.num_blocks,
            "params": self.params,
            "quality": nan_to_none(self.quality),
        }

    @classmethod
    def from_dict(cls, doc, where: str = "memory model") -> "MemoryModel":
        """The model of a `to_dict` document; ValueError naming `where` for anything malformed."""
        return _model_from_doc(doc, where)


def _model_from_doc(doc, where: str) -> MemoryModel:
    check_header(doc, where, FORMAT, VERSION, ("form", "num_blocks", "params", "quality"))
    form = check_form(doc, where, FORMS)
    num_blocks = check_json_int(doc, "num_blocks", where, minimum=0)
    check_params(doc["params"], PARAM_NAMES[form], form, where)
    return MemoryModel(form, doc["params"], num_blocks, check_quality(doc["quality"], QUALITY_KEYS, where))
