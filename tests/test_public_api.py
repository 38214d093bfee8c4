"""The public API: `import lightning_adaptiveload as la` gives every documented name, lazily."""
import importlib
import subprocess
import sys

import lightning_adaptiveload as la

README_NAMES = ["AdaptiveLoadDataModule", "BucketBatchSampler", "CostModel", "CostModelCalibration",
                "LoadBalanceMonitor", "FusedAdaLNSurgery", "apply_fused_adaln", "FusedAdaLN", "adaln_modulate",
                "scale_loss_to_global_mean", "register_adaln_patterns", "TokenSpec", "ShapeMix"]


def test_every_public_name_is_its_defining_modules_object():
    assert set(README_NAMES) <= set(la.__all__)
    for name in la.__all__:
        module = importlib.import_module(f"lightning_adaptiveload.{la._EXPORTS[name]}")
        assert getattr(la, name) is getattr(module, name), name
    assert set(la.__all__) <= set(dir(la))


def test_unknown_name_is_an_attribute_error():
    try:
        la.no_such_name
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("no AttributeError")


def test_import_loads_neither_torch_nor_lightning():
    code = ("import sys, lightning_adaptiveload as la; la.TokenSpec; la.CostModel; "
            "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
