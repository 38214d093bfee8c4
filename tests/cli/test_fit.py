"""`adaptiveload fit`: LightningCLI with the demo config (print_config, and a short CPU run)."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_adaptiveload.cli import main

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "configs" / "demo.yaml"


pytestmark = pytest.mark.usefixtures("one_thread")


def test_print_config_resolves_example_class_paths_from_the_working_directory():
    # sys.path without the repository: `examples.*` must resolve through the cwd inserted by `fit`,
    # as for the installed console script run from a clone.
    code = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.', %r)]; "
            "from lightning_adaptiveload.cli import main; sys.exit(main())" % str(ROOT))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code, "fit", "--config", str(DEMO), "--trainer.max_steps", "7",
                          "--print_config"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    printed = yaml.safe_load(out.stdout)
    assert printed["model"]["class_path"] == "examples.video_dit.module.VideoDiTModule"
    assert printed["model"]["init_args"]["dim"] == 64
    assert printed["trainer"]["max_steps"] == 7  # the command line overrides the file
    assert printed["data"]["init_args"]["policy"] == "balanced"
    names = [cb["class_path"] for cb in printed["trainer"]["callbacks"]]
    assert "lightning_adaptiveload.callbacks.CostModelCalibration" in names


def test_h200_config_parses():
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "examples" / "configs" / "h200_fsdp.yaml"), "--print_config"])
    assert exit_info.value.code == 0


def test_unknown_option_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(DEMO), "--trainer.no_such_option", "1"])
    assert exit_info.value.code != 0
    assert "no_such_option" in capsys.readouterr().err


def _epoch_batches(config_path) -> list[list[str]]:
    """Sample keys of every batch of epoch 0 of the config's DataModule (one rank), after the same
    calibration would have set the cost model: read from the calibration record of the run."""
    from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
    from lightning_adaptiveload.scheduling.cost_model import CostModel

    config = yaml.safe_load(Path(config_path).read_text())
    root = Path(config["trainer"]["default_root_dir"])
    dm = AdaptiveLoadDataModule(**config["data"]["init_args"])
    dm.setup("fit")
    dm.set_cost_model(CostModel.from_json(root / "logs" / "version_0" / "calibration_cost_model.json"))
    loader = dm.build_train_loader(1, 0)
    return [batch["keys"] for batch in loader]


def test_demo_config_trains_a_few_steps_on_cpu(tmp_path, capsys, caplog):
    """The demo config end to end (synthesized shards, calibration, training, balance summary)
    with fewer samples, a smaller calibration grid and 3 steps, everything under tmp_path."""
    config = yaml.safe_load(DEMO.read_text())
    config["trainer"].update(max_steps=3, default_root_dir=str(tmp_path), enable_progress_bar=False,
                             enable_model_summary=False, log_every_n_steps=1)
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path)
    calibration = config["trainer"]["callbacks"][0]["init_args"]
    # any fit is trusted: the trust check has its own tests (tests/callbacks/test_calibration.py)
    calibration.update(num_seq_lens=3, batch_sizes=[1, 2, 4], repeats=1, max_heldout_error=float("inf"), min_work_correlation=-1)
    config["data"]["init_args"].update(shards=str(tmp_path / "shards"), index=str(tmp_path / "index.jsonl"),
                                       synthesize=48, synthesize_shapes=str(ROOT / "examples/configs/demo_mix.jsonl"))
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(config))

    assert main(["fit", "--config", str(path)]) == 0
    printed = capsys.readouterr()
    log_dir = tmp_path / "logs" / "version_0"
    doc = json.loads((log_dir / "calibration.json").read_text())
    assert len(doc["measurements"]) == 9 and doc["cost_model"]["p"] > 0
    # the warm-up covered every (B, latent shape) of the epoch's batches, checked against the
    # batches the sampler's plan holds (samples' shapes read from the index)
    from lightning_adaptiveload.data.index import read_index
    index = read_index(tmp_path / "index.jsonl")
    shape_of = {index.key(i): tuple(int(v) for v in index.latent_shape[i]) for i in range(len(index))}
    verified = {(m["batch_size"], tuple(m["latent_shape"])) for m in doc["verification"]["shapes"]
                if m["status"] == "fits"}
    assert len(verified) == len(doc["verification"]["shapes"]) > 0
    trained = {(len(keys), shape_of[keys[0]]) for keys in _epoch_batches(path)}
    assert trained <= verified
    assert (log_dir / "calibration_fit.png").exists() and (tmp_path / "calibration_cache.json").exists()
    with open(log_dir / "metrics.csv") as f:
        losses = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(losses) == 3 and all(0 < v < 100 for v in losses)
    both = printed.out + printed.err + caplog.text  # Lightning's info lines go through logging
    assert "bucket table after calibration" in both and "CostModelCalibration" in both
    assert (tmp_path / "shards").is_dir() and (tmp_path / "index.jsonl").exists()


@pytest.mark.parametrize("epochs", [None, 3])
def test_rich_progress_bar_title_of_a_step_bounded_run(tmp_path, epochs):
    """max_steps alone leaves max_epochs at -1 (no epoch limit): the bar's title has no epoch total
    (Lightning's RichProgressBar printed `Epoch 0/-2`); with max_epochs N it keeps `Epoch 0/N-1`."""
    pytest.importorskip("rich")
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.loops.utilities import _parse_loop_limits

    from lightning_adaptiveload.cli.fit import cli_class

    args = ["--config", str(DEMO), "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false"]
    args += [] if epochs is None else ["--trainer.max_epochs", str(epochs)]
    cli = cli_class()(subclass_mode_model=True, subclass_mode_data=True, args=args, run=False)
    trainer = cli.trainer
    # the epoch limit as Trainer.fit sets it when it starts (Trainer._run)
    trainer.fit_loop.max_epochs = _parse_loop_limits(trainer.min_steps, trainer.max_steps, trainer.min_epochs,
                                                     trainer.max_epochs, trainer)[1]
    assert trainer.max_epochs == (-1 if epochs is None else epochs)
    bar = trainer.progress_bar_callback
    assert isinstance(bar, RichProgressBar) and type(bar) is not RichProgressBar
    bar.setup(trainer, cli.model, stage="fit")
    title = bar._get_train_description(7)
    assert title.rstrip() == ("Epoch 7" if epochs is None else f"Epoch 7/{epochs - 1}")
    assert len(title) >= len(bar.validation_description)  # padded as Lightning pads it
