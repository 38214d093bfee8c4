import json
from importlib.resources import files

import numpy as np
import pytest

from lightning_adaptiveload.cli import main
from lightning_adaptiveload.scheduling.cost_model import load_cost_model
from lightning_adaptiveload.scheduling.policies import dual_constraint_batch_size, token_equal_batch_size
from lightning_adaptiveload.scheduling.shapes import read_shapes_jsonl

DATA = files("lightning_adaptiveload") / "data"
SHAPES = str(DATA / "reference_mix.jsonl")
CURVE = str(DATA / "h200_dit_cost_curve.json")


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """The shipped H200 curve fitted once, saved as a cost-model JSON."""
    path = tmp_path_factory.mktemp("cm") / "model.json"
    model = load_cost_model(CURVE)
    model.to_json(path)
    return str(path), model


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_on_shipped_measurements(capsys):
    code, out, err = run(capsys, "plan", "--shapes", SHAPES, "--cost-model", CURVE, "--m-mem", "65536",
                         "--world-size", "8")
    assert code == 0 and err == ""
    mix = read_shapes_jsonl(SHAPES)
    oversize = int(mix.counts[mix.tokens > 65536].sum())
    assert oversize > 0 and f"of {mix.num_samples} samples scheduled; dropped: oversize {oversize}," in out
    assert "epoch plan on 8 rank(s)" in out and "policy balanced" in out
    assert "75600" not in out  # the oversize bucket is not scheduled


@pytest.mark.parametrize("policy", ["token_equal", "dual_constraint", "balanced"])
@pytest.mark.parametrize("world, drop_last", [(1, True), (8, True), (8, False)])
def test_plan_json_matches_formulas(capsys, fitted, policy, world, drop_last):
    path, model = fitted
    code, out, _ = run(capsys, "plan", "--shapes", SHAPES, "--cost-model", path, "--m-mem", "65536",
                       "--max-seq-len", "50000", "--json", "--policy", policy, "--world-size", str(world),
                       "--drop-last" if drop_last else "--no-drop-last")
    assert code == 0
    doc = json.loads(out)
    table, stats = doc["bucket_table"], doc["epoch_plan"]
    mix = read_shapes_jsonl(SHAPES)
    fits = mix.tokens <= 50000
    assert table["seq_len"] == sorted(set(mix.tokens[fits].tolist()))  # no two shapes share a count here
    m_comp = model.m_comp(65536, 46800)  # longest bucket <= 50000
    assert table["m_comp"] == (None if policy == "token_equal" else pytest.approx(m_comp))
    full_batches = partial = 0
    for s, n, b, ms in zip(table["seq_len"], table["samples"], table["batch_size"], table["cost_ms"]):
        assert n == int(mix.counts[mix.tokens == s].sum())
        expect = token_equal_batch_size(s, 65536) if policy == "token_equal" \
            else dual_constraint_batch_size(s, 65536, m_comp, model.p)
        assert b == expect and ms == pytest.approx(model.predict(b, s))
        full_batches += n // b
        partial += n % b
    oversize = int(mix.counts[~fits].sum())
    assert stats["samples_total"] == mix.num_samples and stats["dropped_oversize"] == oversize
    assert stats["world_size"] == world and stats["batches"] == stats["steps"] * world
    left_out = stats["dropped_oversize"] + stats["dropped_partial_batch"] + stats["dropped_step_remainder"]
    assert stats["samples_scheduled"] + left_out == mix.num_samples
    if drop_last:
        assert stats["dropped_partial_batch"] == partial and stats["steps"] == full_batches // world
    else:  # every sample that fits is scheduled, in ceil(batches / world) steps
        batches = full_batches + sum(n % b > 0 for n, b in zip(table["samples"], table["batch_size"]))
        assert left_out == oversize and stats["steps"] == -(-batches // world)


def test_plan_explicit_m_comp(capsys, fitted):
    code, out, _ = run(capsys, "plan", "--shapes", SHAPES, "--cost-model", fitted[0], "--m-mem", "65536",
                       "--m-comp", "1e5", "--json")
    table = json.loads(out)["bucket_table"]
    assert table["m_comp"] == 1e5 and table["policy"] == "balanced"
    b = table["batch_size"][table["seq_len"].index(1024)]
    assert b == max(1, min(64, int(np.floor(1e5 / 1024 ** fitted[1].p))))


def test_simulate_json(capsys, fitted):
    code, out, err = run(capsys, "simulate", "--shapes", SHAPES, "--cost-model", fitted[0], "--m-mem", "65536",
                         "--world-size", "16", "--policy", "balanced", "--steps", "300", "--json")
    assert code == 0, err
    r = json.loads(out)
    for key in ("policy", "world_size", "load_cv_mean", "load_max_over_mean_mean", "bubble_frac",
                "predicted_tokens_per_s", "predicted_samples_per_s", "steps", "dropped_oversize"):
        assert key in r
    assert r["policy"] == "balanced" and r["world_size"] == 16 and r["steps"] == 300
    code, out, _ = run(capsys, "simulate", "--shapes", SHAPES, "--cost-model", fitted[0], "--m-mem", "65536",
                       "--world-size", "16", "--policy", "token_equal", "--steps", "300")
    assert code == 0 and "load_cv_mean" in out


@pytest.mark.parametrize("line, needle", [
    ('{"frames": 1, "height": 0, "width": 64}', ":2: field 'height' must be an integer >= 1, got 0"),
    ('{"tokens": 512, "count": 2.5}', ":2: field 'count' must be an integer"),
    ('{"tokens": 512', ":2: not valid JSON"),
    ('{"frames": 1, "height": 64}', ":2: needs 'tokens'"),
])
def test_malformed_shapes(capsys, tmp_path, fitted, line, needle):
    shapes = tmp_path / "shapes.jsonl"
    shapes.write_text('{"tokens": 1024, "count": 3}\n' + line + "\n")
    code, out, err = run(capsys, "plan", "--shapes", str(shapes), "--cost-model", fitted[0], "--m-mem", "65536")
    assert code == 2 and out == ""
    assert needle in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("text, needle", [
    ("{not json", "not valid JSON"),
    ('{"measurements": [{"batch_size": 1, "seq_len": 256}]}', "measurements[0] is missing 'time_ms'"),
    ('{"format": "adaptiveload.cost_model", "version": 1}', "missing keys"),
    ("[1, 2]", "neither a cost model"),
])
def test_malformed_cost_model(capsys, tmp_path, text, needle):
    path = tmp_path / "cm.json"
    path.write_text(text)
    code, out, err = run(capsys, "simulate", "--shapes", SHAPES, "--cost-model", str(path), "--m-mem", "65536",
                         "--world-size", "2", "--policy", "balanced", "--steps", "3")
    assert code == 2 and needle in err and "Traceback" not in err


def test_missing_file_and_too_many_ranks(capsys, fitted):
    code, _, err = run(capsys, "plan", "--shapes", "/nonexistent/shapes.jsonl", "--cost-model", fitted[0],
                       "--m-mem", "65536")
    assert code == 2 and "No such file" in err
    code, _, err = run(capsys, "simulate", "--shapes", SHAPES, "--cost-model", fitted[0], "--m-mem", "65536",
                       "--world-size", "1000000", "--policy", "token_equal", "--steps", "3")
    assert code == 2 and "world size 1000000 is larger than the number of batches" in err


def test_help_loads_neither_torch_nor_lightning():
    import subprocess
    import sys

    code = ("import sys; from lightning_adaptiveload.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_index_command_offers_the_duplicate_rules_of_build_index():
    from lightning_adaptiveload.cli import build_parser
    from lightning_adaptiveload.data.index import DUPLICATES

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["index"]
    assert tuple(next(a for a in sub._actions if a.dest == "duplicates").choices) == DUPLICATES


@pytest.fixture(scope="module")
def h200_models(tmp_path_factory):
    """Memory and depth cost models fitted to the H200 activation-checkpointing measurements, as JSON."""
    from lightning_adaptiveload.scheduling.depth_cost_model import DepthCostModel
    from lightning_adaptiveload.scheduling.memory_model import MemoryModel
    from tests.helpers.h200_ac import H200_AC, NUM_BLOCKS

    b, s, k, t, peak = np.array(H200_AC).T
    memory = MemoryModel.fit(b, s, k, peak * 2**30, num_blocks=NUM_BLOCKS)
    depth = DepthCostModel.fit(b, s, k, t, num_blocks=NUM_BLOCKS)
    folder = tmp_path_factory.mktemp("models")
    memory.to_json(folder / "memory.json")
    depth.to_json(folder / "depth.json")
    return str(folder / "memory.json"), str(folder / "depth.json"), memory, depth


def test_plan_with_a_memory_model_shows_depth_and_peak_and_keeps_every_sample(capsys, h200_models):
    from lightning_adaptiveload.scheduling.depth_choice import choose_batch_and_depth

    memory_path, depth_path, memory, depth = h200_models
    args = ("plan", "--shapes", SHAPES, "--cost-model", depth_path, "--memory-model", memory_path,
            "--device-memory-gib", "139.8", "--m-mem", "65536", "--world-size", "8")
    code, out, err = run(capsys, *args, "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    table, stats = doc["bucket_table"], doc["epoch_plan"]
    mix = read_shapes_jsonl(SHAPES)
    assert table["seq_len"] == sorted(set(mix.tokens.tolist())) and 75600 in table["seq_len"]
    ref = choose_batch_and_depth(np.array(table["seq_len"]), memory, depth, device_memory_bytes=139.8 * 2**30,
                                 max_tokens=65536)
    assert table["batch_size"] == ref.batch_size.tolist() and table["checkpointed"] == ref.checkpointed.tolist()
    assert table["peak_bytes"] == pytest.approx(ref.peak_bytes.tolist())
    assert stats["dropped_oversize"] == 0 and table["memory_plan"]["max_memory_fraction"] == 0.85
    checkpointed_of = dict(zip(table["seq_len"], table["checkpointed"]))  # the numbers docs/memory.md quotes
    assert checkpointed_of[75600] == 21 and min(table["checkpointed"]) == 0 and max(table["checkpointed"]) == 22
    code, out, _ = run(capsys, *args)
    assert code == 0 and "memory model: MemoryModel(" in out and "memory plan: peak <= 118.83 GiB" in out
    long_line = next(line for line in out.splitlines() if line.split()[:1] == ["75600"])
    assert long_line.split()[5] == "1"  # (S, the latent shape in three parts, samples, B): B = 1 over m_mem
    # the token-budget baselines under the same plan: k = L everywhere, predicted peaks shown
    code, out, _ = run(capsys, *args, "--policy", "token_equal", "--json")
    table = json.loads(out)["bucket_table"]
    assert set(table["checkpointed"]) == {30}
    assert table["batch_size"] == [token_equal_batch_size(s, 65536) for s in table["seq_len"]]


def test_plan_memory_model_errors_name_the_argument(capsys, fitted, h200_models):
    memory_path, depth_path, _, _ = h200_models
    base = ("plan", "--shapes", SHAPES, "--m-mem", "65536")
    code, _, err = run(capsys, *base, "--cost-model", depth_path, "--memory-model", memory_path)
    assert code == 2 and "--memory-model needs --device-memory-gib" in err
    code, _, err = run(capsys, *base, "--cost-model", fitted[0], "--memory-model", memory_path,
                       "--device-memory-gib", "80")
    assert code == 2 and "--cost-model must be a depth cost model" in err
    code, _, err = run(capsys, *base, "--cost-model", fitted[0], "--device-memory-gib", "80")
    assert code == 2 and "--device-memory-gib needs --memory-model" in err
