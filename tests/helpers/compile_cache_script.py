"""One run of a tiny compiled model (inductor on CPU) with lightning_adaptiveload.compile_cache, in a
process of its own so that torch's in-memory caches start empty (tests/test_compile_cache.py).

    python compile_cache_script.py DIRECTORY OUT.json [SHAPES] [--save-each]

CompileCache.load() first (as the callback does: a first run finds no bundle), every shape compiled
(SHAPES: rows x 8 inputs, e.g. "3,5", default both of SHAPES below), then save(); with --save-each, a
save after every shape (as the callback saves before training and again after it). OUT.json gets the
run's cache-lookup counts (read_cache_counts), load's result and the last save's record, and per shape
the compiled forward output and input gradient beside an fp64 eager reference of the same weights and
inputs.
"""
import copy
import json
import sys

import torch

from lightning_adaptiveload.compile_cache import CompileCache, cache_key, read_cache_counts

SHAPES = ((3, 8), (5, 8))  # two shapes: the second is a recompile (dynamic after it, torch's default)


def main(directory: str, out: str, shapes: tuple[tuple[int, int], ...] = SHAPES, save_each: bool = False) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model).double()
    cache = CompileCache(directory, cache_key("tiny-mlp", "auto", torch.device("cpu")))
    loaded = cache.load()  # also in a first run, as the callback does: it routes torch's caches
    compiled = torch.compile(model)
    runs = []
    record = None
    for shape in shapes:
        x = torch.randn(shape, requires_grad=True)
        y = compiled(x)
        y.square().sum().backward()
        x64 = x.detach().double().requires_grad_()
        y64 = reference(x64)
        y64.square().sum().backward()
        runs.append({"y": y.tolist(), "grad": x.grad.tolist(), "y_ref": y64.tolist(), "grad_ref": x64.grad.tolist()})
        if save_each:
            record = cache.save() or record
    if not save_each:
        record = cache.save()
    with open(out, "w") as f:
        json.dump({"counts": read_cache_counts(), "loaded": loaded, "saved": record, "runs": runs}, f)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--save-each"]
    rows = tuple((int(r), 8) for r in args[2].split(",")) if len(args) > 2 else SHAPES
    main(args[0], args[1], rows, save_each="--save-each" in sys.argv)
