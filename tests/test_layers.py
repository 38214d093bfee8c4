"""The package's layers (docs/architecture.md): no import runs back up, nothing imports examples/ or
benchmarks/, and the scheduling core imports no torch."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "lightning_adaptiveload"
BASE = {"_validation", "_jsonl", "_distributed", "_imports"}
# layer -> the package's layers it may import (besides itself and BASE)
ALLOWED = {
    "scheduling": set(),
    "data": {"scheduling"},
    "encode": {"scheduling", "data"},
    "monitoring": {"scheduling"},
    "calibration": {"scheduling"},
    "checkpointing": {"scheduling"},
    "ops": set(),
    "surgery": {"ops"},
    "loss": set(),
    "callbacks": {"scheduling", "data", "monitoring", "calibration", "checkpointing", "ops", "surgery", "loss"},
    "cli": {"scheduling", "data", "encode", "monitoring", "ops", "__init__"},
    "__main__": {"cli"},
    "__init__": set(),  # imports lazily, by name (checked in test_public_api.py)
}
ALLOWED.update({name: set() for name in BASE})


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _layer(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).parts
    return parts[0].removesuffix(".py")


def test_no_import_runs_back_up_the_layers():
    bad = []
    for path in ROOT.rglob("*.py"):
        src = _layer(path)
        for name in _imports(path):
            top = name.split(".")[0]
            if top in ("examples", "benchmarks", "tests"):
                bad.append(f"{path}: imports {name}")
            if top != "lightning_adaptiveload":
                continue
            dst = name.split(".")[1] if "." in name else "__init__"
            if dst != src and dst not in BASE and dst not in ALLOWED[src]:
                bad.append(f"{path}: layer {src} imports {name}")
    assert not bad, "\n".join(bad)


def test_scheduling_imports_no_torch_or_lightning():
    for path in (ROOT / "scheduling").rglob("*.py"):
        tops = {name.split(".")[0] for name in _imports(path)}
        assert not tops & {"torch", "lightning"}, path
