import json

import numpy as np
import pytest

from lightning_adaptiveload.scheduling.cost_model import CostModel
from lightning_adaptiveload.scheduling.depth_cost_model import DEPTH_FORMAT, DEPTH_QUALITY_KEYS, DepthCostModel
from tests.helpers.h200_ac import H200_AC

L = 30

BASE = {"floor": 12.0, "c0": 0.1, "c1": 2.4e-3, "c2": 1.5e-7, "k": 5.0}


def base_ms(b, s):
    """Independent reference of the floor_work form (docs/cost_model.md)."""
    work = BASE["c0"] * b + BASE["c1"] * b * s + BASE["c2"] * b * s * s
    return (BASE["floor"] ** BASE["k"] + work ** BASE["k"]) ** (1 / BASE["k"])


def synthetic(g=0.24, rel_noise=0.003, seed=0):
    """A k = L grid, and a second depth measured at some of its (B, S)."""
    rng = np.random.default_rng(seed)
    s = np.round(np.exp(rng.uniform(np.log(256), np.log(48000), 30)))
    b = np.maximum(1, np.round(np.exp(rng.uniform(0, np.log(np.maximum(2, 131072 / s))))))
    pick = rng.choice(30, 8, replace=False)
    bb, ss = np.concatenate([b, b[pick]]), np.concatenate([s, s[pick]])
    k = np.concatenate([np.full(30, L), rng.choice([0, 10, 20, 25], 8)])
    t = base_ms(bb, ss) * (1 - g * (L - k) / L) * (1 + rel_noise * rng.standard_normal(38))
    return bb, ss, k, t


def test_recovers_the_recompute_fraction_and_the_base_fit():
    b, s, k, t = synthetic(g=0.24, seed=1)
    model = DepthCostModel.fit(b, s, k, t, num_blocks=L)
    assert model.recompute_fraction == pytest.approx(0.24, abs=0.01)
    full = k == L
    direct = CostModel.fit(b[full], s[full], t[full])
    assert model.base.form == direct.form and model.base.params == pytest.approx(direct.params, rel=1e-9)
    # quality: relative error of the predicted ratio t(k) / t(L) on the pairs
    partner = {(bi, si): ti for bi, si, ti in zip(b[full], s[full], t[full])}
    ratio = np.array([ti / partner[(bi, si)] for bi, si, ti in zip(b[~full], s[~full], t[~full])])
    pred = 1 - model.recompute_fraction * (L - k[~full]) / L
    assert model.quality["mean_rel_err"] == pytest.approx(np.mean(np.abs(pred - ratio) / ratio), rel=1e-9)
    assert model.quality["heldout_mean_rel_err"] >= model.quality["mean_rel_err"]


def test_predict_without_depth_is_the_base_model_and_scales_with_depth():
    b, s, k, t = synthetic(seed=2)
    model = DepthCostModel.fit(b, s, k, t, num_blocks=L)
    qb, qs = np.array([[1, 4], [16, 64]]), np.array([[40000, 8000], [2000, 512]])
    np.testing.assert_array_equal(model.predict(qb, qs), model.base.predict(qb, qs))
    np.testing.assert_array_equal(model.predict(qb, qs, L), model.base.predict(qb, qs))
    g = model.recompute_fraction
    np.testing.assert_allclose(model.predict(qb, qs, [[0, 5], [17, 29]]),
                               model.base.predict(qb, qs) * (1 - g * (L - np.array([[0, 5], [17, 29]])) / L),
                               rtol=1e-12)
    assert isinstance(model.predict(2, 1024, 7), float)
    with pytest.raises(ValueError, match="checkpointed"):
        model.predict(2, 1024, L + 1)


def test_h200_second_depth_predicted_within_one_percent_of_the_measured_ratio():
    b, s, k, t, _ = np.array(H200_AC).T
    model = DepthCostModel.fit(b, s, k, t, num_blocks=L)
    assert 0.22 < model.recompute_fraction < 0.27  # recomputing all 30 blocks is ~1/4 of the step
    assert model.quality["max_rel_err"] < 0.01  # measured 0.64%
    assert model.quality["heldout_max_rel_err"] < 0.015  # measured 0.96%


def test_points_without_a_full_depth_partner_count_against_the_base_prediction():
    """Verification measures (B, S, k) calibration never paired: their ratio is taken over t_L's
    prediction. With exact (noise-free) times g is recovered from unpaired points alone."""
    b, s, k, t = synthetic(seed=3, rel_noise=0.0)
    full = k == L
    base = CostModel.fit(b[full], s[full], t[full])
    rng = np.random.default_rng(4)
    ub, us = rng.integers(1, 9, 6).astype(float), rng.integers(300, 40000, 6).astype(float)
    uk = rng.choice([0, 7, 15], 6)
    ut = base.predict(ub, us) * (1 - 0.3 * (L - uk) / L)  # g = 0.3 against the base's own prediction
    model = DepthCostModel.fit(np.concatenate([b[full], ub]), np.concatenate([s[full], us]),
                               np.concatenate([k[full], uk]), np.concatenate([t[full], ut]), num_blocks=L, base=base)
    assert model.recompute_fraction == pytest.approx(0.3, rel=1e-9)


def test_points_without_a_second_depth_or_with_bad_depths_are_rejected():
    b, s, k, t = synthetic(seed=3)
    full = k == L
    with pytest.raises(ValueError, match="needs points at k < 30"):
        DepthCostModel.fit(b[full], s[full], k[full], t[full], num_blocks=L)
    with pytest.raises(ValueError, match="checkpointed"):
        DepthCostModel.fit(b, s, np.where(full, L, -1), t, num_blocks=L)
    with pytest.raises(ValueError, match="num_blocks"):
        DepthCostModel.fit(b, s, k, t, num_blocks=0)


def test_json_round_trip(tmp_path):
    model = DepthCostModel.fit(*synthetic(seed=4), num_blocks=L)
    path = tmp_path / "depth.json"
    model.to_json(path)
    doc = json.loads(path.read_text())
    assert doc["format"] == DEPTH_FORMAT and doc["base"]["format"] == "adaptiveload.cost_model"
    back = DepthCostModel.from_json(path)
    assert (back.num_blocks, back.recompute_fraction, back.quality) == (L, model.recompute_fraction, model.quality)
    assert (back.base.form, back.base.params) == (model.base.form, model.base.params)


def _valid_doc():
    base = CostModel("power", {"a": 9.0, "b": 3e-4, "p": 1.3}, p=1.3, quality={}).to_dict()
    return {"format": DEPTH_FORMAT, "version": 1, "num_blocks": L, "recompute_fraction": 0.25,
            "quality": {k: None for k in DEPTH_QUALITY_KEYS}, "base": base}


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format="adaptiveload.cost_model"), "format"),
    (lambda d: d.pop("base"), "missing"),
    (lambda d: d.update(version=3), "version"),
    (lambda d: d.update(num_blocks=0), "num_blocks"),
    (lambda d: d.update(recompute_fraction=1.5), "recompute_fraction"),
    (lambda d: d.update(quality={}), "quality"),
    (lambda d: d["base"]["params"].update(a=-1.0), "'base': params\\['a'\\]"),
])
def test_from_json_rejects_malformed(tmp_path, mutate, message):
    doc = _valid_doc()
    mutate(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message) as info:
        DepthCostModel.from_json(path)
    assert str(path) in str(info.value)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_valid_doc()))
    assert DepthCostModel.from_json(good).predict(1, 1000, 0) == pytest.approx((9 + 3e-4 * 1000**1.3) * 0.75)
