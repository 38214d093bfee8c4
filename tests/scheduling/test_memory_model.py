import json
import math

import numpy as np
import pytest

from lightning_adaptiveload.scheduling.memory_model import FORMAT, FORMS, NO_BOUND, MemoryModel
from lightning_adaptiveload.scheduling.fitting import QUALITY_KEYS
from tests.helpers.h200_ac import H200_AC, H200_OOM
from tests.helpers.json_docs import assert_rejected

GiB = 2**30
L = 30

TRUE = {  # bytes; realistic for a 1.3B DiT with AdamW
    "linear": {"m0": 2.0e10, "c": 3.0e7, "a": 2.0e5, "c_k": 9.0e6, "b": 1.3e5},
    "quadratic": {"m0": 2.0e9, "c": 1.0e6, "a": 4.0e4, "q": 2.0, "c_k": 5.0e5, "b": 3.0e4, "q_k": 8.0},
}


def formula(params, b, s, k, num_blocks=L):
    """Independent fp64 reference of the documented form: max(L - k, 1) blocks' activations live at the
    peak (the block backward recomputes counts as one when every block is checkpointed)."""
    live = np.maximum(num_blocks - np.asarray(k, dtype=np.float64), 1.0) if num_blocks else np.zeros(np.shape(k))
    b, s = (np.asarray(v, dtype=np.float64) for v in (b, s))
    p = {n: params.get(n, 0.0) for n in ("m0", "c", "a", "q", "c_k", "b", "q_k")}
    return p["m0"] + b * (p["c"] + p["a"] * s + p["q"] * s * s) + live * b * (p["c_k"] + p["b"] * s + p["q_k"] * s * s)


def synthetic(form, rel_noise=0.005, n=40, seed=0):
    rng = np.random.default_rng(seed)
    s = np.round(np.exp(rng.uniform(np.log(256), np.log(48000), n)))
    b = np.maximum(1, np.round(np.exp(rng.uniform(0, np.log(np.maximum(2, 65536 / s))))))
    k = rng.choice([L, L // 2, L - 3], size=n)
    peak = formula(TRUE[form], b, s, k) * (1 + rel_noise * rng.standard_normal(n))
    return b, s, k, peak


@pytest.mark.parametrize("form", FORMS)
def test_each_form_recovers_its_parameters_and_reports_quality(form):
    b, s, k, peak = synthetic(form, rel_noise=0.002, seed=1)
    model = MemoryModel.fit(b, s, k, peak, num_blocks=L, form=form)
    assert model.form == form and model.num_blocks == L
    for name, true in TRUE[form].items():
        assert model.params[name] == pytest.approx(true, rel=0.1), name
    pred = formula(model.params, b, s, k)
    rel = np.abs(pred - peak) / peak
    assert model.quality["mean_rel_err"] == pytest.approx(rel.mean(), rel=1e-9)
    assert model.quality["max_rel_err"] == pytest.approx(rel.max(), rel=1e-9)
    assert model.quality["r2"] == pytest.approx(1 - np.sum((pred - peak) ** 2) / np.sum((peak - peak.mean()) ** 2))
    assert model.quality["mean_rel_err"] < 0.004


def test_auto_picks_linear_on_linear_data_and_quadratic_on_quadratic_data():
    assert MemoryModel.fit(*synthetic("linear", seed=2), num_blocks=L).form == "linear"
    quad = MemoryModel.fit(*synthetic("quadratic", seed=3), num_blocks=L)
    assert quad.form == "quadratic"
    assert set(quad.candidates) == set(FORMS)
    heldout = {f: c["quality"]["heldout_mean_rel_err"] for f, c in quad.candidates.items()}
    assert heldout["quadratic"] == min(heldout.values())


def test_heldout_error_is_leave_one_out():
    b, s, k, peak = synthetic("linear", rel_noise=0.02, n=14, seed=4)
    model = MemoryModel.fit(b, s, k, peak, num_blocks=L, form="linear")
    errors = []
    for i in range(len(peak)):  # reference: refit without point i
        keep = np.arange(len(peak)) != i
        fold = MemoryModel.fit(b[keep], s[keep], k[keep], peak[keep], num_blocks=L, form="linear")
        errors.append(abs(fold.predict(b[i], s[i], k[i]) - peak[i]) / peak[i])
    assert model.quality["heldout_mean_rel_err"] == pytest.approx(np.mean(errors), rel=1e-9)
    assert model.quality["heldout_max_rel_err"] == pytest.approx(np.max(errors), rel=1e-9)


def test_h200_measurements_fit_within_two_percent_and_predict_the_out_of_memory_points():
    b, s, k, _, peak_gib = np.array(H200_AC).T
    model = MemoryModel.fit(b, s, k, peak_gib * GiB, num_blocks=L)
    assert model.form == "linear"  # cuDNN attention keeps no S^2 matrix
    rel = np.abs(model.predict(b, s, k) / (peak_gib * GiB) - 1)
    assert rel.max() < 0.02  # measured: 1.5%
    assert model.quality["heldout_mean_rel_err"] < 0.02  # measured: 1.1% (max 6.0%, the only B = 256 point)
    # m0 is the fixed memory of 1.3B fp32 parameters + gradients + AdamW's two moments (16 bytes each)
    assert model.params["m0"] / GiB == pytest.approx(1.3e9 * 16 / GiB, rel=0.1)
    # one more live block at 65k tokens holds ~9.6 GiB: k = 30 -> 20 (the issue's +86.8 GiB) adds 9 live
    # blocks, not 10 (the 8.7 GiB each), since at k = 30 one recomputed block is live already
    per_block = model.predict(64, 1024, L - 2) - model.predict(64, 1024, L - 1)
    assert per_block / GiB == pytest.approx((120.19 - 33.42) / 9, rel=0.03)
    # checkpointing the last block as well saves no memory
    assert model.predict(64, 1024, L - 1) == model.predict(64, 1024, L)
    ob, os_, ok = np.array(H200_OOM).T
    assert np.all(model.predict(ob, os_, ok) > 139 * GiB)  # every point that ran out of memory


def test_predict_broadcasts_defaults_to_full_checkpointing_and_matches_formula():
    b, s, k, peak = synthetic("quadratic", seed=5)
    model = MemoryModel.fit(b, s, k, peak, num_blocks=L, form="quadratic")
    rng = np.random.default_rng(6)
    qb, qs, qk = rng.integers(1, 300, (4, 7)), rng.integers(100, 80000, (4, 7)), rng.integers(0, L + 1, (4, 7))
    np.testing.assert_allclose(model.predict(qb, qs, qk), formula(model.params, qb, qs, qk), rtol=1e-12)
    assert isinstance(model.predict(3, 5000), float)
    assert model.predict(3, 5000) == model.predict(3, 5000, L)
    assert model.predict(2, np.array([256, 1024]), 0).shape == (2,)
    for bad in (-1, L + 1, 2.5):
        with pytest.raises(ValueError, match="checkpointed"):
            model.predict(1, 256, bad)


def test_min_checkpointed_and_max_batch_size_equal_brute_force():
    b, s, k, peak = synthetic("linear", seed=7)
    model = MemoryModel.fit(b, s, k, peak, num_blocks=L)
    rng = np.random.default_rng(8)
    all_k = np.arange(L + 1)
    for _ in range(300):
        qb, qs = int(rng.integers(1, 200)), int(rng.integers(64, 80000))
        budget = float(rng.uniform(0.1, 3.0)) * model.predict(qb, qs, L // 2)
        fitting = all_k[model.predict(qb, qs, all_k) <= budget]
        got_k, fits = model.min_checkpointed(qb, qs, budget)
        assert bool(fits) == (fitting.size > 0)
        assert int(got_k) == (fitting.min() if fitting.size else L)
        depth = int(rng.integers(0, L + 1))
        bs = np.arange(1, 5000)
        fitting_b = bs[model.predict(bs, qs, depth) <= budget]
        assert int(model.max_batch_size(qs, budget, depth)) == (fitting_b.max() if fitting_b.size else 0)
    # vectorised over B and S
    ks, fits = model.min_checkpointed(np.arange(1, 9)[:, None], np.array([512, 4096, 30000]), 3e10)
    assert ks.shape == fits.shape == (8, 3) and ks.dtype == np.int64


def test_memory_that_does_not_grow_with_batch_sets_no_bound():
    flat = MemoryModel("linear", {"m0": 1e9, "c": 0.0, "a": 0.0, "c_k": 0.0, "b": 0.0}, num_blocks=4)
    assert int(flat.max_batch_size(1024, 2e9)) == int(flat.max_batch_size(1024, 2e9, 0)) == NO_BOUND
    assert int(flat.max_batch_size(1024, 5e8)) == 0
    blocks_only = MemoryModel("linear", {"m0": 1e9, "c": 0.0, "a": 0.0, "c_k": 0.0, "b": 1e3}, num_blocks=4)
    assert int(blocks_only.max_batch_size(1024, 2e9)) == int((2e9 - 1e9) // (1 * 1e3 * 1024))  # k = L: 1 live
    assert int(blocks_only.max_batch_size(1024, 2e9, 0)) == int((2e9 - 1e9) // (4 * 1e3 * 1024))


def test_model_without_switchable_blocks_fits_one_depth():
    rng = np.random.default_rng(9)
    s = rng.integers(100, 9000, 12).astype(float)
    b = rng.integers(1, 32, 12).astype(float)
    peak = formula({"m0": 1e8, "c": 1e4, "a": 300.0}, b, s, 0, num_blocks=0)
    model = MemoryModel.fit(b, s, np.zeros(12), peak, num_blocks=0)
    assert model.params["c_k"] == model.params["b"] == 0.0
    assert model.params["a"] == pytest.approx(300.0, rel=1e-6)
    assert model.min_checkpointed(4, 1000, 1e12) == (0, True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(checkpointed=[L] * 8), "2 checkpointing depths"),
    (dict(checkpointed=[L, 0, L, 0, L, 0, L, L + 1]), "checkpointed"),
    (dict(checkpointed=[L, 0, L, 0, L, 0, L, 2.5]), "checkpointed"),
    (dict(peak_bytes=[1e9] * 7 + [0.0]), "peak_bytes"),
    (dict(batch_sizes=[1, 2, 3]), "equal length"),
    (dict(seq_lens=[[256] * 8]), "1-D"),
    (dict(num_blocks=-1), "num_blocks"),
    (dict(num_blocks=True), "num_blocks"),
    (dict(form="cubic"), "form"),
])
def test_fit_rejects_bad_input(kwargs, message):
    args = dict(batch_sizes=[1, 2, 4, 8, 1, 2, 4, 8], seq_lens=[256, 256, 512, 512, 1024, 1024, 2048, 2048],
                checkpointed=[L, 0] * 4, peak_bytes=[1e9 + i * 1e7 for i in range(8)], num_blocks=L)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        MemoryModel.fit(**args)


def test_fit_needs_enough_points():
    with pytest.raises(ValueError, match="at least 7"):
        MemoryModel.fit([1, 2, 4, 8, 1, 2], [256] * 6, [L, 0] * 3, [1e9 + i for i in range(6)], num_blocks=L)
    with pytest.raises(ValueError, match="at least 9"):
        MemoryModel.fit([1, 2, 4, 8, 1, 2, 3, 4], [256] * 8, [L, 0] * 4, [1e9 + i for i in range(8)],
                        num_blocks=L, form="quadratic")


def test_json_round_trip(tmp_path):
    model = MemoryModel.fit(*synthetic("quadratic", seed=10), num_blocks=L)
    path = tmp_path / "memory.json"
    model.to_json(path)
    doc = json.loads(path.read_text())
    assert doc["format"] == FORMAT and doc["version"] == 2 and doc["num_blocks"] == L
    back = MemoryModel.from_json(path)
    assert (back.form, back.params, back.num_blocks, back.quality) == (model.form, model.params, L, model.quality)


def test_hand_built_model_round_trips_with_unknown_quality(tmp_path):
    model = MemoryModel("linear", TRUE["linear"], num_blocks=L)
    path = tmp_path / "hand.json"
    model.to_json(path)
    back = MemoryModel.from_json(path)
    assert all(math.isnan(back.quality[k]) for k in QUALITY_KEYS)
    assert back.predict(4, 1024, 7) == pytest.approx(float(formula(TRUE["linear"], 4, 1024, 7)), rel=1e-12)


def _valid_doc():
    return {"format": FORMAT, "version": 2, "form": "linear", "num_blocks": L, "params": dict(TRUE["linear"]),
            "quality": {k: 0.01 for k in QUALITY_KEYS}}


def _with(key, value):
    def mutate(doc):
        doc[key] = value
        return doc
    return mutate


def _without(key):
    def mutate(doc):
        del doc[key]
        return doc
    return mutate


def _param(key, value):
    def mutate(doc):
        doc["params"][key] = value
        return doc
    return mutate


MALFORMED = {
    "list": (lambda d: [d], "JSON object"),
    "wrong format": (_with("format", "adaptiveload.cost_model"), "format"),
    "no version": (_without("version"), "version"),
    "version 1 (the peak linear in L - k)": (_with("version", 1), "version"),
    "unknown form": (_with("form", "cubic"), "form"),
    "num_blocks negative": (_with("num_blocks", -2), "num_blocks"),
    "num_blocks float": (_with("num_blocks", 30.0), "num_blocks"),
    "no params": (_without("params"), "missing"),
    "params of the other form": (_with("params", dict(TRUE["quadratic"])), "params"),
    "param negative": (_param("a", -1.0), "params\\['a'\\]"),
    "param string": (_param("b", "1e5"), "params\\['b'\\]"),
    "quality missing key": (_with("quality", {"r2": 0.9}), "quality"),
    "quality string": (_with("quality", {k: "x" for k in QUALITY_KEYS}), "quality"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_from_json_rejects_malformed(tmp_path, case):
    mutate, message = MALFORMED[case]
    assert_rejected(MemoryModel.from_json, tmp_path, mutate(_valid_doc()), message)


def test_from_json_rejects_bad_text_and_missing_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"format": "adaptiveload.memory_model", "params": {"m0": NaN}}')
    with pytest.raises(ValueError, match="NaN"):
        MemoryModel.from_json(path)
    with pytest.raises(ValueError, match="cannot read"):
        MemoryModel.from_json(tmp_path / "absent.json")

