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
Held-out error is leave-one-out cross-validation (k-fold for large sets, see `_folds`), so
form="auto" picks the form that predicts unseen shapes best, not the one with most parameters.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares, nnls

from lightning_adaptiveload._validation import is_finite_number, require_choice, require_int, require_number

FORMAT = "adaptiveload.cost_model"
VERSION = 1
FORMS = ("power", "linear_quadratic", "floor_work")  # "auto" prefers the earlier form on ties
PARAM_NAMES = {
    "power": ("a", "b", "p"),
    "linear_quadratic": ("a", "c1", "c2"),
    "floor_work": ("floor", "c0", "c1", "c2", "k"),
}
QUALITY_KEYS = ("r2", "mean_rel_err", "max_rel_err", "heldout_mean_rel_err", "heldout_max_rel_err")
MAX_LOO_POINTS = 64  # above this, cross-validation uses K_FOLDS folds instead of leave-one-out
K_FOLDS = 16
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


def _folds(n: int, b: np.ndarray, s: np.ndarray) -> list[np.ndarray]:
    """Held-out index sets: leave-one-out for n <= MAX_LOO_POINTS, else K_FOLDS folds where the
    point of rank r in (S, B) order goes to fold r % K_FOLDS (deterministic, input-order free)."""
    if n <= MAX_LOO_POINTS:
        return [np.array([i]) for i in range(n)]
    rank = np.empty(n, dtype=np.int64)
    rank[np.lexsort((b, s))] = np.arange(n)
    return [np.flatnonzero(rank % K_FOLDS == f) for f in range(K_FOLDS)]


def _rel_err(pred: np.ndarray, t: np.ndarray) -> np.ndarray:
    return np.abs(pred - t) / t


def _fit_form(form: str, b, s, t) -> tuple[dict, dict]:
    """Fit one form on all points; return (params, quality) with cross-validated held-out error."""
    params = _least_squares(form, b, s, t, _starts(form, b, s, t))
    pred = _PREDICT[form](params, b, s)
    heldout = np.empty_like(t)
    for idx in _folds(len(t), b, s):
        keep = np.ones(len(t), dtype=bool)
        keep[idx] = False
        # warm start from the full fit: deterministic, and far cheaper than a fresh multistart
        fold_params = _least_squares(form, b[keep], s[keep], t[keep], [params])
        heldout[idx] = _rel_err(_PREDICT[form](fold_params, b[idx], s[idx]), t[idx])
    return params, fit_quality(pred, t, heldout)


def fit_quality(pred: np.ndarray, measured: np.ndarray, heldout_rel_err: np.ndarray) -> dict:
    """QUALITY_KEYS of a fit: r2 and relative errors of `pred` against `measured` on the fit points,
    mean and max of the cross-validated relative errors `heldout_rel_err`."""
    ss_tot = float(np.sum((measured - measured.mean()) ** 2))
    rel = _rel_err(pred, measured)
    return {
        "r2": 1.0 - float(np.sum((pred - measured) ** 2)) / ss_tot if ss_tot > 0 else float("nan"),
        "mean_rel_err": float(rel.mean()),
        "max_rel_err": float(rel.max()),
        "heldout_mean_rel_err": float(heldout_rel_err.mean()),
        "heldout_max_rel_err": float(heldout_rel_err.max()),
    }


def _positive_1d(name: str, values) -> np.ndarray:
    """`values` as a 1-D float64 array of finite numbers > 0 (measurements of the model files of
    scheduling/); a ValueError naming `name` otherwise."""
    a = np.asarray(values, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    bad = ~(np.isfinite(a) & (a > 0))
    if bad.any():
        raise ValueError(f"{name} must be finite and > 0, got {a[bad][:3].tolist()}")
    return a


def _check_measurements(batch_sizes, seq_lens, times_ms) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    b, s, t = (_positive_1d(name, values) for name, values in
               (("batch_sizes", batch_sizes), ("seq_lens", seq_lens), ("times_ms", times_ms)))
    if not len(b) == len(s) == len(t):
        raise ValueError(f"batch_sizes, seq_lens, times_ms must have equal length, got {len(b)}, {len(s)}, {len(t)}")
    return b, s, t


class CostModel:
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
        b, s, t = _check_measurements(batch_sizes, seq_lens, times_ms)
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
            "quality": _nan_to_none(self.quality),
        }

    def to_json(self, path) -> None:
        """Write the model as plain JSON (see docs/cost_model.md for the format)."""
        _write_json(path, self.to_dict())

    @classmethod
    def from_json(cls, path) -> "CostModel":
        """Read a model written by to_json; ValueError naming the file for anything malformed."""
        return _model_from_doc(_read_json(path), str(path))


def _read_json(path) -> object:
    def reject_constant(name):
        raise ValueError(f"{path}: non-standard JSON constant {name}")

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    try:
        return json.loads(text, parse_constant=reject_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


# --- checks of model JSON documents, shared by the model files of scheduling/ ------------------

def _write_json(path, doc: dict) -> None:
    Path(path).write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n", encoding="utf-8")


def _nan_to_none(values: dict) -> dict:
    """JSON has no NaN: unknown numbers are written as null."""
    return {k: (v if math.isfinite(v) else None) for k, v in values.items()}


def _check_header(doc, where: str, fmt: str, version: int, keys: tuple[str, ...]) -> dict:
    """`doc` if it is an object with "format" `fmt`, "version" `version` and every key of `keys`."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != fmt:
        raise ValueError(f"{where}: 'format' must be {fmt!r}, got {doc.get('format')!r}")
    missing = [k for k in ("version", *keys) if k not in doc]
    if missing:
        raise ValueError(f"{where}: missing keys {missing}")
    if doc["version"] != version or isinstance(doc["version"], bool):
        raise ValueError(f"{where}: unsupported 'version' {doc['version']!r} (this reader knows {version})")
    return doc


def _check_form(doc: dict, where: str, forms: tuple[str, ...]) -> str:
    """doc["form"] if it is one of `forms`."""
    if doc["form"] not in forms:
        raise ValueError(f"{where}: unknown 'form' {doc['form']!r}, expected one of {forms}")
    return doc["form"]


def _check_json_int(doc: dict, key: str, where: str, minimum: int) -> int:
    """doc[key] if it is a JSON integer (not a bool, not a float) >= minimum."""
    value = doc[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: '{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def _check_params(params, names: tuple[str, ...], form: str, where: str) -> None:
    """`params` has exactly the keys `names`, each a finite number >= 0."""
    if not isinstance(params, dict) or set(params) != set(names):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(f"{where}: 'params' of form {form!r} must have keys {list(names)}, got {got}")
    for name, value in params.items():
        require_number(f"{where}: params[{name!r}]", value, minimum=0)


def _check_quality(quality, keys: tuple[str, ...], where: str) -> dict:
    """The `keys` of `quality`, each a number or null; null read as NaN (unknown)."""
    if not isinstance(quality, dict):
        raise ValueError(f"{where}: 'quality' must be an object, got {type(quality).__name__}")
    for key in keys:
        if key not in quality:
            raise ValueError(f"{where}: 'quality' is missing {key!r}")
        if quality[key] is not None and not is_finite_number(quality[key]):
            raise ValueError(f"{where}: quality[{key!r}] must be a number or null, got {quality[key]!r}")
    return {k: (float("nan") if quality[k] is None else quality[k]) for k in keys}


def _model_from_doc(doc, where: str) -> CostModel:
    _check_header(doc, where, FORMAT, VERSION, ("form", "params", "p", "quality"))
    form = _check_form(doc, where, FORMS)
    params = doc["params"]
    _check_params(params, PARAM_NAMES[form], form, where)
    if form == "floor_work" and not params["k"] >= 1:
        raise ValueError(f"{where}: params['k'] must be >= 1, got {params['k']!r}")
    require_number(f"{where}: 'p'", doc["p"], positive=True)
    return CostModel(form, params, doc["p"], _check_quality(doc["quality"], QUALITY_KEYS, where))


def read_measurements(path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(batch_sizes, seq_lens, times_ms) float64 arrays of a measurements JSON
    {"measurements": [{"batch_size", "seq_len", "time_ms", ...}, ...]}."""
    doc = _read_json(path)
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
    doc = _read_json(path)
    if isinstance(doc, dict) and "format" in doc:
        return _model_from_doc(doc, str(path))
    if isinstance(doc, dict) and "measurements" in doc:
        return CostModel.fit(*read_measurements(path), form=form)
    raise ValueError(f"{path}: neither a cost model (needs \"format\": {FORMAT!r}) "
                     f"nor a measurements file (needs a 'measurements' list)")


def plot_fit(model: CostModel, batch_sizes, seq_lens, times_ms, path) -> None:
    """PNG: measured step time (markers) and the model (lines) against B, one colour per S, log
    axes; and the relative error of each point against B*S (points need not be the fit points)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b, s, t = _check_measurements(batch_sizes, seq_lens, times_ms)
    fig, (ax_fit, ax_err) = plt.subplots(1, 2, figsize=(13, 5.5))
    colors = plt.cm.viridis(np.linspace(0, 0.95, len(np.unique(s))))
    for color, seq in zip(colors, np.unique(s)):
        on = s == seq
        ax_fit.plot(b[on], t[on], "o", color=color, label=f"S={int(seq)}")
        if b[on].min() < b[on].max():
            grid = np.geomspace(b[on].min(), b[on].max(), 50)
            ax_fit.plot(grid, model.predict(grid, np.full_like(grid, seq)), "-", color=color)
        else:  # a single batch size: mark the prediction instead of a curve
            ax_fit.plot(b[on], model.predict(b[on], s[on]), "x", color=color)
        ax_err.plot(b[on] * seq, 100 * (model.predict(b[on], s[on]) - t[on]) / t[on], "o", color=color)
    ax_fit.set(xscale="log", yscale="log", xlabel="batch size B", ylabel="step time (ms)",
               title=f"{model.form}: " + ", ".join(f"{k}={v:.3g}" for k, v in model.params.items()))
    ax_fit.legend(fontsize=7, ncol=2)
    rel = _rel_err(model.predict(b, s), t)
    ax_err.axhline(0, color="gray", lw=0.8)
    ax_err.set(xscale="log", xlabel="tokens B*S", ylabel="(predicted - measured) / measured (%)",
               title=f"these {len(t)} points: mean {100 * rel.mean():.1f}%, max {100 * rel.max():.1f}%; "
                     f"fit's held-out mean {100 * model.quality['heldout_mean_rel_err']:.1f}%")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- step time with a checkpointing depth k (docs/memory.md) ---------------------------------

DEPTH_FORMAT = "adaptiveload.depth_cost_model"
DEPTH_VERSION = 1
DEPTH_QUALITY_KEYS = ("mean_rel_err", "max_rel_err", "heldout_mean_rel_err", "heldout_max_rel_err")


def check_depths(checkpointed, num_blocks: int, name: str = "checkpointed") -> np.ndarray:
    """`checkpointed` (k, blocks under activation checkpointing) as a float64 array; ValueError
    naming `name` unless every entry is a whole number in [0, num_blocks]."""
    k = np.asarray(checkpointed, dtype=np.float64)
    bad = ~(np.isfinite(k) & (k == np.round(k)) & (k >= 0) & (k <= num_blocks))
    if np.any(bad):
        raise ValueError(f"{name} must be whole numbers in [0, num_blocks={num_blocks}], got {k[bad][:3].tolist()}")
    return k


def _recompute_fraction(u: np.ndarray, ratio: np.ndarray) -> float:
    """g minimising sum(((1 - g*u) - ratio) / ratio)^2), clipped to [0, 1]."""
    w2 = 1.0 / ratio**2
    return float(np.clip(np.sum(w2 * u * (1.0 - ratio)) / np.sum(w2 * u * u), 0.0, 1.0))


class DepthCostModel:
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
        b, s, t = _check_measurements(batch_sizes, seq_lens, times_ms)
        num_blocks = require_int("num_blocks", num_blocks)
        k = check_depths(checkpointed, num_blocks)
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
        rel = _rel_err(1.0 - g * u, ratio)
        heldout = np.full(len(u), np.nan)
        if len(u) > 1:
            for i in range(len(u)):
                keep = np.arange(len(u)) != i
                heldout[i] = _rel_err(1.0 - _recompute_fraction(u[keep], ratio[keep]) * u[i], ratio[i])
        quality = {"mean_rel_err": float(rel.mean()), "max_rel_err": float(rel.max()),
                   "heldout_mean_rel_err": float(heldout.mean()), "heldout_max_rel_err": float(heldout.max())}
        return cls(base, num_blocks, g, quality)

    def predict(self, batch_size, seq_len, checkpointed=None):
        """Step time in ms; checkpointed=None means k = L (the base model's time). Scalars give a
        float, arrays broadcast and give an array."""
        t = self.base.predict(batch_size, seq_len)
        if checkpointed is None:
            return t
        u = (self.num_blocks - check_depths(checkpointed, self.num_blocks)) / self.num_blocks
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
            "quality": _nan_to_none(self.quality),
            "base": self.base.to_dict(),
        }

    def to_json(self, path) -> None:
        """Write the model as plain JSON (to_dict)."""
        _write_json(path, self.to_dict())

    @classmethod
    def from_json(cls, path) -> "DepthCostModel":
        """Read a model written by to_json; ValueError naming the file for anything malformed."""
        return cls.from_dict(_read_json(path), str(path))

    @classmethod
    def from_dict(cls, doc, where: str = "depth cost model") -> "DepthCostModel":
        """The model of a `to_dict` document; ValueError naming `where` for anything malformed."""
        _check_header(doc, where, DEPTH_FORMAT, DEPTH_VERSION, ("num_blocks", "recompute_fraction", "quality", "base"))
        num_blocks = _check_json_int(doc, "num_blocks", where, minimum=1)
        g = doc["recompute_fraction"]
        if not is_finite_number(g) or not 0 <= g <= 1:
            raise ValueError(f"{where}: 'recompute_fraction' must be a number in [0, 1], got {g!r}")
        quality = _check_quality(doc["quality"], DEPTH_QUALITY_KEYS, where)
        return cls(_model_from_doc(doc["base"], f"{where}: 'base'"), num_blocks, g, quality)
