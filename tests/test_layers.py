"""The package's layers (docs/architecture.md): no import runs back up, nothing imports examples/ or
benchmarks/, and the scheduling core imports no torch. Inside surgery/, the idioms package's
modules import only down its flow (surgery/idioms/__init__.py), and nothing below it imports it."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "lightning_adaptiveload"
BASE = {"_validation", "_jsonl", "_distributed", "_imports", "_environment"}
# layer -> the package's layers it may import (besides itself and BASE)
ALLOWED = {
    "scheduling": set(),
    "data": {"scheduling"},
    "encode": {"scheduling", "data"},
    "monitoring": {"scheduling"},
    "calibration": {"scheduling", "attention"},
    "attention": {"scheduling"},
    "checkpointing": {"scheduling"},
    "ops": set(),
    "surgery": {"ops"},
    "loss": set(),
    "clipping": set(),
    "compile_cache": {"scheduling"},
    "callbacks": {"scheduling", "data", "monitoring", "calibration", "checkpointing", "ops", "surgery", "loss",
                  "clipping", "attention", "compile_cache"},
    "cli": {"scheduling", "data", "encode", "monitoring", "ops", "__init__"},
    "__main__": {"cli"},
    "__init__": set(),  # imports lazily, by name (checked in test_public_api.py)
}
ALLOWED.update({name: set() for name in BASE})
IDIOMS = "lightning_adaptiveload.surgery.idioms"
# surgery/idioms/ module -> the package's modules it may import: the runtime and the scope at the
# bottom, the entry point (recogniser, re-exported by __init__) on top
IDIOMS_ALLOWED = {
    "runtime": set(),
    "scope": set(),
    "matcher": {"runtime", "scope"},
    "single_use": {"matcher", "scope"},
    "rewrite": {"runtime", "scope", "matcher", "single_use"},
    "recogniser": {"runtime", "rewrite"},
    "__init__": {"recogniser"},
}


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


def test_imports_are_absolute():
    """The checks here read absolute module names: a relative import would pass them unseen."""
    relative = [f"{path}:{node.lineno}" for path in ROOT.rglob("*.py")
                for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative, relative


def test_idioms_modules_import_down_the_flow():
    package = ROOT / "surgery" / "idioms"
    assert {p.stem for p in package.glob("*.py")} == set(IDIOMS_ALLOWED)  # a new module gets its place above
    bad = []
    for path in package.glob("*.py"):
        for name in _imports(path):
            if name == IDIOMS or name.startswith(IDIOMS + "."):
                dst = name.removeprefix(IDIOMS).lstrip(".").split(".")[0] or "__init__"
                if dst not in IDIOMS_ALLOWED[path.stem]:
                    bad.append(f"{path}: {path.stem} imports {name}")
    for path in (ROOT / "surgery").glob("*.py"):  # core, verify, the patterns: below the idiom pass
        if path.name != "__init__.py" and any(n == IDIOMS or n.startswith(IDIOMS + ".") for n in _imports(path)):
            bad.append(f"{path}: below the idiom pass, imports {IDIOMS}")
    assert not bad, "\n".join(bad)
