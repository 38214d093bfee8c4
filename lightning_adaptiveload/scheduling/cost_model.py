"""Step-time cost model t(B, S) in ms, fitted to shape benchmarks, and the M_comp rule.

B is the batch size (samples), S the tokens per sample. Forms (all parameters > 0):

- "power" (the paper):      t = a + b * B * S^p
- "linear_quadratic" (FLOPs): t = a + c1 * B*S + c2 * B*S^2
  (projections/MLP scale with tokens B*S, self-attention with B*S^2)
- "floor_work" (roofline-like): t = (floor^k + work^k)^(1/k),
  work = c0 * B + c1 * B*S + c2 * B*S^2,
  a smooth max of a launch/latency floor (small shapes leave the GPU under-used, so time stays
  flat) and the FLOP work; k > 1 sets how sharp the knee is (k -> inf is max(floor, work)).
  c0 is per-sample work that does not grow with S (an MMDiT's text tokens: cross-attention K/V
  projections of the prompt, per-sample modulation).

Fits minimise relative error, residuals (pred - t) / t, with scipy's nonlinear least squares.
Held-out error is leave-one-out cross-validation (k-fold for large sets, see `fitting.folds`), so
form="auto" picks the form that predicts unseen shapes best, not the one with most parameters.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.optimize import least_squares, nnls

from lightning_adaptiveload._validation import require_choice, require_int, require_number
from lightning_adaptiveload.scheduling.fitting import QUALITY_KEYS, check_measurements, fit_quality, folds, rel_err
from lightning_adaptiveload.scheduling.model_io import (JsonDocument, check_form, check_header, check_params,
                                                        check_quality, nan_to_none, read_json)

FORMAT = "adaptiveload.cost_model"
VERSION = 1
FORMS = ("power", "linear_quadratic", "floor_work")  # "auto" prefers the earlier form on ties
PARAM_NAMES = {
    "power": ("a", "b", "p"),
    "linear_quadratic": ("a", "c1", "c2"),
    "floor_work": ("floor", "c0", "c1", "c2", "k"),
}
_LOG_MIN, _LOG_MAX = -80.0, 80.0  # bounds on log-parameters, keep exp() finite
_P_BOUNDS = (0.05, 4.0)
_K_MAX = 64.0


# --- forms: each maps a parameter dict and (B, S) float arrays to time (ms) ---------------

def _predict_power(params: dict, b: np.ndarray, s: np.ndarray) -> np.ndarray:
    return params["a"] + params["b"] * b * s ** params["p"]


def _predict_linear_quadratic(params: dict, b: np.ndarray, s: np.ndarray) -> np.ndarray:
    return params["a"] + params["c1"] * b * s + params["c2"] * b * s * s


def _predict_floor_work(params: dict, b: np.ndarray, s: np.ndarray) -> np.ndarray:
    floor, k = params["floor"], params["k"]
    work = params["c0"] * b + params["c1"] * b * s + params["c2"] * b * s * s
    top = np.maximum(floor, work)  # factor out the larger term so x^k cannot overflow
    return top * ((floor / top) ** k + (work / top) ** k) ** (1.0 / k)


_PREDICT = {"power": _predict_power, "linear_quadratic": _predict_linear_quadratic,
            "floor_work": _predict_floor_work}


# --- fitting: parameters are optimised in an unconstrained-ish space x ----------------------
# Positive scale parameters as log(value); power's p as itself; floor_work's k as log(k - 1).

def _to_params(form: str, x: np.ndarray) -> dict:
    if form == "power":
        return {"a": math.exp(x[0]), "b": math.exp(x[1]), "p": float(x[2])}
    if form == "linear_quadratic":
        return dict(zip(PARAM_NAMES[form], (math.exp(v) for v in x)))
    return {"floor": math.exp(x[0]), "c0": math.exp(x[1]), "c1": math.exp(x[2]), "c2": math.exp(x[3]),
            "k": 1.0 + math.exp(x[4])}


def _to_x(form: str, params: dict) -> np.ndarray:
    tiny = math.exp(_LOG_MIN)
    if form == "power":
        return np.array([math.log(max(params["a"], tiny)), math.log(params["b"]), params["p"]])
    if form == "linear_quadratic":
        return np.log(np.maximum([params["a"], params["c1"], params["c2"]], tiny))
    return np.log(np.maximum([params["floor"], params["c0"], params["c1"], params["c2"], params["k"] - 1.0], tiny))


def _bounds(form: str) -> tuple[list[float], list[float]]:
    n = len(PARAM_NAMES[form])
    lo, hi = [_LOG_MIN] * n, [_LOG_MAX] * n
    if form == "power":
        lo[2], hi[2] = _P_BOUNDS
    if form == "floor_work":
        lo[4], hi[4] = -10.0, math.log(_K_MAX - 1.0)
    return lo, hi


def _starts(form: str, b: np.ndarray, s: np.ndarray, t: np.ndarray) -> list[dict]:
    """Initial guesses from the data scale; several for the shape parameters (p, k)."""
    tokens = b * s
    if form == "power":
        a = 0.5 * float(t.min())
        return [{"a": a, "b": float(np.median(np.maximum(t - a, 1e-3 * t) / (b * s ** p))), "p": p}
                for p in (1.0, 1.5, 2.0)]
    # work coefficients: non-negative least squares of t on (B, B*S, B*S^2), rows weighted by 1/t
    # (relative error); a zero coefficient is clamped to a tiny positive one by _to_x
    design = np.stack([b, tokens, tokens * s], axis=1) / t[:, None]
    scale = design.max(axis=0)
    c0, c1, c2 = (float(c) for c in nnls(design / scale, np.ones_like(t))[0] / scale)
    if form == "linear_quadratic":
        return [{"a": 0.5 * float(t.min()), "c1": c1, "c2": c2}]
    floor = float(np.median(t[tokens <= np.median(tokens)]))
    return [{"floor": floor, "c0": c0, "c1": c1, "c2": c2, "k": k} for k in (2.0, 8.0)]


def _least_squares(form: str, b, s, t, starts: list[dict]) -> dict:
    predict = _PREDICT[form]

    def residuals(x):
        return (predict(_to_params(form, x), b, s) - t) / t

    lo, hi = _bounds(form)
    best = None
    for start in starts:
        x0 = np.clip(_to_x(form, start), lo, hi)
        result = least_squares(residuals, x0, bounds=(lo, hi), method="trf", x_scale="jac", max_nfev=2000)
        if best is None or result.cost < best.cost:
            best = result
    return _to_params(form, best.x)


def _fit_form(form: str, b, s, t) -> tuple[dict, dict]:
    """Fit one form on all points; return (params, quality) with cross-validated held-out error."""
    params = _least_squares(form, b, s, t, _starts(form, b, s, t))
    pred = _PREDICT[form](params, b, s)
    heldout = np.empty_like(t)
    for idx in folds(len(t), b, s):
        keep = np.ones(len(t), dtype=bool)
        keep[idx] = False
        # warm start from the full fit: deterministic, and far cheaper than a fresh multistart
        fold_params = _least_squares(form, b[keep], s[keep], t[keep], [params])
        heldout[idx] = rel_err(_PREDICT[form](fold_params, b[idx], s[idx]), t[idx])
    return params, fit_quality(pred, t, heldout)


class CostModel(JsonDocument):
    """A fitted step-time model t(B, S) in ms. See the module docstring for the forms."""

    def __init__(self, form: str, params: dict, p: float, quality: dict, candidates: dict | None = None):
        require_choice("form", form, FORMS)
        if set(params) != set(PARAM_NAMES[form]):
            raise ValueError(f"form {form!r} needs params {PARAM_NAMES[form]}, got {sorted(params)}")
        self.form = form
        self.params = {name: float(params[name]) for name in PARAM_NAMES[form]}
        self.p = float(p)  # exponent of the paper's power form on the same data (dual-constraint rule)
        # every QUALITY_KEYS entry present (NaN where unknown, e.g. a hand-built model)
        self.quality = {key: float(quality.get(key, float("nan"))) for key in QUALITY_KEYS}
        self.candidates = candidates or {}  # form -> {"params", "quality"} of every form fitted

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v:.4g}" for k, v in self.params.items())
        power_p = "" if self.form == "power" else f", p={self.p:.4g}"  # power's p is in params
        return f"CostModel(form={self.form!r}, {params}{power_p})"

    @classmethod
    def fit(cls, batch_sizes, seq_lens, times_ms, form: str = "auto") -> "CostModel":
        """Fit t(B, S) ms to measurements (1-D arrays of equal length, all > 0).

        form: one of FORMS, or "auto" for the lowest cross-validated mean relative error.
        Each form needs at least (its parameter count + 2) points so that every held-out
        fold still has more points than parameters. The power form is always fitted too, to set p.
        """
        b, s, t = check_measurements(batch_sizes, seq_lens, times_ms)
        require_choice("form", form, ("auto", *FORMS))
        wanted = [f for f in FORMS if form in ("auto", f) or f == "power"]
        enough = [f for f in wanted if len(t) >= len(PARAM_NAMES[f]) + 2]
        if "power" not in enough or (form != "auto" and form not in enough):
            need = max(len(PARAM_NAMES[f]) + 2 for f in ({"power", form} - {"auto"}))
            raise ValueError(f"need at least {need} measurements to fit form {form!r}, got {len(t)}")
        candidates = {}
        for f in enough:
            params, quality = _fit_form(f, b, s, t)
            candidates[f] = {"params": params, "quality": quality}
        if form == "auto":
            form = min(candidates, key=lambda f: (candidates[f]["quality"]["heldout_mean_rel_err"], FORMS.index(f)))
        chosen = candidates[form]
        return cls(form, chosen["params"], candidates["power"]["params"]["p"], chosen["quality"], candidates)

    def predict(self, batch_size, seq_len):
        """Step time in ms; scalars give a float, arrays broadcast and give an array."""
        b = np.asarray(batch_size, dtype=np.float64)
        s = np.asarray(seq_len, dtype=np.float64)
        t = _PREDICT[self.form](self.params, b, s)
        return float(t) if np.ndim(t) == 0 else t

    @property
    def dual_p(self) -> float:
        """Exponent for the dual-constraint rule: max(p, 1). A fitted p below 1 (step time growing
        slower than tokens: launch- or overhead-bound shapes, e.g. a tiny model) would, as a compute
        bound, cap short buckets far below their memory limit for no predicted saving; with p = 1
        the rule falls back to token-equal batch sizes there."""
        return max(self.p, 1.0)

    def m_comp(self, m_mem: int, ref_seq_len: int) -> float:
        """Compute budget (tokens^p, p = `dual_p`) for the dual-constraint rule: B_ref * S_ref^p with
        S_ref = ref_seq_len and B_ref = max(1, m_mem // S_ref), the batch S_ref gets at the memory
        limit. Buckets then get at most the compute of S_ref's memory-limited batch.

        S_ref is where the two constraints cross: for p > 1 buckets shorter than S_ref stay
        memory-bound and longer ones become compute-bound. With S_ref = the longest scheduled
        bucket (no bucket gets more compute than the straggler), the compute bound therefore only
        bites as far as B_ref * S_ref falls short of m_mem (rounding of m_mem // S_ref); a shorter
        S_ref throttles every longer bucket to B * S^p <= M_comp (docs/cost_model.md)."""
        m_mem, ref_seq_len = require_int("m_mem", m_mem), require_int("ref_seq_len", ref_seq_len)
        b_ref = max(1, m_mem // ref_seq_len)
        # the slack keeps floor(M_comp / S_ref^p) == B_ref despite float rounding
        return b_ref * float(ref_seq_len) ** self.dual_p * (1.0 + 1e-9)

    def to_dict(self) -> dict:
        """The JSON document of the model (see docs/cost_model.md for the format)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "form": self.form,
            "params": self.params,
            "p": self.p,
            "quality": nan_to_none(self.quality),
        }

    @classmethod
    def from_dict(cls, doc, where: str = "cost model") -> "CostModel":
        """The model of a `to_dict` document; ValueError naming `where` for anything malformed."""
        return model_from_doc(doc, where)


def model_from_doc(doc, where: str) -> CostModel:
    """The CostModel of a `to_dict` document; ValueError naming `where` for anything malformed."""
    check_header(doc, where, FORMAT, VERSION, ("form", "params", "p", "quality"))
    form = check_form(doc, where, FORMS)
    params = doc["params"]
    check_params(params, PARAM_NAMES[form], form, where)
    if form == "floor_work" and not params["k"] >= 1:
        raise ValueError(f"{where}: params['k'] must be >= 1, got {params['k']!r}")
    require_number(f"{where}: 'p'", doc["p"], positive=True)
    return CostModel(form, params, doc["p"], check_quality(doc["quality"], QUALITY_KEYS, where))


def read_measurements(path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(batch_sizes, seq_lens, times_ms) float64 arrays of a measurements JSON
    {"measurements": [{"batch_size", "seq_len", "time_ms", ...}, ...]}."""
    doc = read_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("measurements"), list) or not doc["measurements"]:
        raise ValueError(f"{path}: expected an object with a non-empty 'measurements' list")
    rows = []
    for i, m in enumerate(doc["measurements"]):
        if not isinstance(m, dict):
            raise ValueError(f"{path}: measurements[{i}] must be an object, got {type(m).__name__}")
        row = []
        for key in ("batch_size", "seq_len", "time_ms"):
            if key not in m:
                raise ValueError(f"{path}: measurements[{i}] is missing {key!r}")
            row.append(require_number(f"{path}: measurements[{i}][{key!r}]", m[key], positive=True))
        rows.append(row)
    b, s, t = np.asarray(rows, dtype=np.float64).T
    return b, s, t


def load_cost_model(path, form: str = "auto") -> CostModel:
    """A fitted-model JSON (format adaptiveload.cost_model), or a measurements JSON that is
    fitted on the fly with `form`."""
    doc = read_json(path)
    if isinstance(doc, dict) and "format" in doc:
        return model_from_doc(doc, str(path))
    if isinstance(doc, dict) and "measurements" in doc:
        return CostModel.fit(*read_measurements(path), form=form)
    raise ValueError(f"{path}: neither a cost model (needs \"format\": {FORMAT!r}) "
                     f"nor a measurements file (needs a 'measurements' list)")


