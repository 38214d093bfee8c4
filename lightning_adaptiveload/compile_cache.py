"""A torch.compile cache that persists across runs: a second run of the same config compiles nothing.

What a compile costs on the GPU is inductor's code generation and autotuning (39-62 s per new graph
for the shipped 30-block config on an H200, docs/lightning.md "Compiled training"); dynamo's tracing
is cheap beside it. torch keeps the results in two places, both used here:

- its on-disk caches (the FX graph cache of inductor's compiled graphs, the AOTAutograd cache of
  forward/backward pairs, triton's kernels), under `TORCHINDUCTOR_CACHE_DIR` (default
  /tmp/torchinductor_<user>, which a fresh machine or a /tmp clean-up loses). `CompileCache` points
  that variable at `<directory>/inductor` unless the user chose a directory of their own;
- a portable bundle of every artifact this process compiled or read from those caches
  (`torch.compiler.save_cache_artifacts`), merged with the bundle an earlier run wrote, written to
  `<directory>/compile_cache-<digest>.bin` and hot-loaded into the on-disk caches of a later run, so a
  run whose on-disk cache is elsewhere or empty (another machine, a fresh device session) still hits.

torch's bundle is a sequence of chunks, one per artifact kind per `save_cache_artifacts` call, and
`torch.compiler.load_cache_artifacts` reads the chunks into a dict: a later chunk of a kind replaces the
earlier ones, so a bundle saved twice in a process (before training and after it, as the callback
does) loads only the second save's additions (torch 2.11-2.14.1; on an H100, 27 of 187 artifacts,
benchmarks/results/gpu_session14). `_read_artifacts` reads every chunk and `_write_artifacts` writes
one chunk per kind, with torch's own (private) serializer functions; on a torch without them the public
functions are used, with that loss, and a warning says so.

The bundle's key (`cache_key`) is what makes another run's graphs the same as this run's beyond what
torch checks itself: torch, CUDA and python versions, the device, the model (calibration's
`model_fingerprint`) and the compile mode. torch's own cache keys hash each graph, its inputs and the
compiler configuration, so a bundle of another key could only miss, not give wrong results; the key
keeps bundles of different configs apart. Beside the bundle, `compile_cache-<digest>.json` records
the key, the number of artifacts of each kind, the byte count, the bundle's sha256 and the date.

Trust: the bundle is torch's own serialized format, which unpickles compiled code. The cache
directory must be trusted like any compile cache (torch's own under /tmp included): it is written by
this class only, never a user-provided input, and the bundle is only read from the configured
directory, after its sha256 matched the one recorded when it was written. A bundle that is missing,
of another key, corrupt or refused by torch is a logged warning and a cold compile, never a crash.
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import json
import logging
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_adaptiveload.scheduling.model_io import write_bytes, write_json

log = logging.getLogger(__name__)

FORMAT = "adaptiveload.compile_cache"
VERSION = 1
INDUCTOR_CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
# (counters category, counter) -> our name; torch/_inductor/codecache.py and
# torch/_functorch/_aot_autograd/autograd_cache.py (torch 2.11-2.14) count these per graph looked up.
CACHE_COUNTERS = {("inductor", "fxgraph_cache_hit"): "fxgraph_hits",
                  ("inductor", "fxgraph_cache_miss"): "fxgraph_misses",
                  ("inductor", "fxgraph_cache_bypass"): "fxgraph_bypasses",
                  ("aot_autograd", "autograd_cache_hit"): "autograd_hits",
                  ("aot_autograd", "autograd_cache_miss"): "autograd_misses"}


def device_name(device: torch.device) -> str:
    """The GPU's name for a CUDA device ("NVIDIA H200"), else the device type ("cpu")."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def cache_key(model_hash: str, compile_mode: str | None, device: torch.device) -> dict:
    """What decides whether another run's compiled graphs are this run's: versions of torch, CUDA
    and python, the device, `model_hash` (e.g. calibration.record.model_fingerprint of the module)
    and the compile mode (e.g. "auto", "dynamic"; None: the caller has no name for it)."""
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "device": device_name(device), "model": model_hash, "compile_mode": compile_mode}


def read_cache_counts() -> dict[str, int]:
    """Process-wide totals of torch's compile-cache lookups (CACHE_COUNTERS' names): a graph
    read from the FX graph cache is a hit, one inductor compiled is a miss, one it would not cache a
    bypass; the AOTAutograd counts are per forward/backward pair. All 0 before torch._dynamo is
    imported (nothing can have compiled)."""
    if "torch._dynamo" not in sys.modules:
        return dict.fromkeys(CACHE_COUNTERS.values(), 0)
    from torch._dynamo.utils import counters

    # .get: counters is a defaultdict; reading must not create categories.
    return {name: int(counters.get(category, {}).get(counter, 0))
            for (category, counter), name in CACHE_COUNTERS.items()}


@functools.cache
def _torch_serializer():
    """torch's (private) bundle serializer pieces: (AppendingByteSerializer, CacheArtifactManager,
    _serialize_single_cache, _deserialize_single_cache), or None on a torch that lacks them."""
    try:
        from torch.compiler._cache import CacheArtifactManager, _deserialize_single_cache, _serialize_single_cache
        from torch.utils._appending_byte_serializer import AppendingByteSerializer
    except ImportError:
        return None
    if not all(hasattr(c, name) for c, name in ((AppendingByteSerializer, "to_list"), (AppendingByteSerializer, "extend"),
                                                 (CacheArtifactManager, "populate_caches"),
                                                 (CacheArtifactManager, "_ensure_cache_artifacts_registered"))):
        return None
    return AppendingByteSerializer, CacheArtifactManager, _serialize_single_cache, _deserialize_single_cache


def _read_artifacts(data: bytes) -> dict[str, list]:
    """Every artifact of torch's bundle `data`, by kind, each key once (the first of a repeated one):
    all of its chunks, where torch's loader keeps only the last chunk of each kind."""
    serializer, manager, _, read_chunk = _torch_serializer()
    manager._ensure_cache_artifacts_registered()
    artifacts: dict[str, dict[str, object]] = {}
    for kind, chunk in serializer.to_list(data, deserialize_fn=read_chunk):
        by_key = artifacts.setdefault(kind, {})
        for artifact in chunk:
            by_key.setdefault(artifact.key, artifact)
    return {kind: list(by_key.values()) for kind, by_key in artifacts.items()}


def _write_artifacts(artifacts: dict[str, list]) -> bytes:
    """torch's bundle format with one chunk per kind (what `_read_artifacts` and torch's loader both read
    whole)."""
    serializer, _, write_chunk, _ = _torch_serializer()
    out = serializer(serialize_fn=write_chunk)
    out.extend(artifacts.items())
    return out.to_bytes()


def _keys(artifacts: dict[str, list]) -> set[tuple[str, str]]:
    return {(kind, artifact.key) for kind, chunk in artifacts.items() for artifact in chunk}


class CompileCache:
    """The compile cache of one config in `directory` (made as needed), under `key` (`cache_key`).

    `load()` before the first compiled call, `save()` after compiling (again whenever new graphs may
    have been compiled: only a bundle with artifacts it does not hold yet is written). One process
    writes (rank 0 of a distributed run); every process may load.
    """

    def __init__(self, directory: str | os.PathLike, key: dict, info: Callable[[str], None] = log.info,
                 warn: Callable[[str], None] = log.warning):
        if not isinstance(key, dict) or not key:
            raise ValueError(f"CompileCache: key must be a non-empty dict (cache_key), got {key!r}")
        try:
            text = json.dumps(key, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"CompileCache: key must be JSON-serializable (cache_key): {e}") from None
        self.directory = Path(directory)
        self.key = key
        self.digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        self.bundle_path = self.directory / f"compile_cache-{self.digest}.bin"
        self.record_path = self.directory / f"compile_cache-{self.digest}.json"
        self._info, self._warn = info, warn
        self._held: set[tuple[str, str]] = set()  # (kind, artifact key) loaded from or saved to the bundle

    def use_for_torch_caches(self) -> dict[str, str]:
        """Point torch's on-disk compile caches at `<directory>/inductor` unless the user chose a
        directory (TORCHINDUCTOR_CACHE_DIR set to other than torch's default, which torch writes into
        the variable at its first use); returns what was set. Warns when torch's FX graph or
        AOTAutograd cache is switched off: then nothing compiled is cached or bundled."""
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        made = {}
        current = os.environ.get(INDUCTOR_CACHE_VARIABLE)
        if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
            made[INDUCTOR_CACHE_VARIABLE] = str((self.directory / "inductor").resolve())
            os.environ.update(made)
        import torch._functorch.config
        import torch._inductor.config

        off = [name for name, on in (("FX graph cache (torch._inductor.config.fx_graph_cache)",
                                      torch._inductor.config.fx_graph_cache),
                                     ("AOTAutograd cache (torch._functorch.config.enable_autograd_cache)",
                                      torch._functorch.config.enable_autograd_cache)) if not on]
        if off:
            self._warn(f"CompileCache: torch's {' and '.join(off)} is off: compiled graphs are neither cached "
                       "nor bundled")
        return made

    def load(self) -> bool:
        """Route torch's caches (`use_for_torch_caches`), then hot-load the bundle into them; True
        when it loaded. No bundle: False (a first run). A bundle without its record, of another
        key, whose bytes do not match the record, or that torch refuses: a warning and False."""
        self.use_for_torch_caches()
        if not self.bundle_path.exists():
            self._info(f"CompileCache: no compile cache at {self.bundle_path} yet: this run compiles")
            return False
        try:
            record = json.loads(self.record_path.read_text(encoding="utf-8"))
            data = self.bundle_path.read_bytes()
        except (OSError, ValueError) as e:
            return self._refuse(f"cannot read it or its record {self.record_path}: {type(e).__name__}: {e}")
        if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("version") != VERSION:
            return self._refuse(f"its record {self.record_path} is not a {FORMAT} version {VERSION} record")
        if record.get("key") != self.key:
            return self._refuse(f"it was written under another key ({record.get('key')!r}, this run's: {self.key!r})")
        if hashlib.sha256(data).hexdigest() != record.get("sha256"):
            return self._refuse("its bytes do not match the sha256 recorded with it (corrupt or replaced)")
        try:
            if _torch_serializer() is None:
                self._warn_public_only()
                info = torch.compiler.load_cache_artifacts(data)
                if info is None:
                    return self._refuse("torch could not load it (its log says why)")
                loaded = info.artifacts
            else:
                artifacts = _read_artifacts(data)
                _, manager, _, _ = _torch_serializer()
                manager.populate_caches(artifacts)
                loaded = {kind: [a.key for a in chunk] for kind, chunk in artifacts.items()}
        except Exception as e:  # torch's own format and checks: any failure means a cold compile
            return self._refuse(f"torch could not load it: {type(e).__name__}: {e}")
        self._held |= {(kind, key) for kind, keys in loaded.items() for key in keys}
        self._info(f"CompileCache: loaded {len(self._held)} compile artifacts "
                   f"({_by_kind({kind: len(keys) for kind, keys in loaded.items()})}) from "
                   f"{self.bundle_path}")
        return True

    def save(self) -> dict | None:
        """Bundle every artifact this process compiled or read from torch's caches, merged with the
        bundle already in the directory (a short run does not drop the graphs only a longer one met),
        and write it with its record (atomically: a reader sees the old bundle or the new one); returns
        the record, or None when nothing was written: nothing compiled, or the bundle already holds it
        all."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            self._info(f"CompileCache: nothing compiled in this process: {self.bundle_path} left as it is")
            return None
        data, info = saved
        whole = _torch_serializer() is not None
        if whole:
            ours = _read_artifacts(data)
            keys = _keys(ours)
        else:  # torch's bytes as they are: this process's artifacts only
            self._warn_public_only()
            keys = {(kind, key) for kind, names in info.artifacts.items() for key in names}
            counts = {kind: len(names) for kind, names in info.artifacts.items()}
        if keys <= self._held:
            self._info(f"CompileCache: no new compile artifacts: {self.bundle_path} left as it is")
            return None
        if whole:
            merged = self._bundled()
            for kind, chunk in ours.items():
                have = {a.key for a in merged.setdefault(kind, [])}
                merged[kind] += [a for a in chunk if a.key not in have]
            data, keys = _write_artifacts(merged), _keys(merged)
            counts = {kind: len(chunk) for kind, chunk in merged.items()}
        record = {"format": FORMAT, "version": VERSION, "key": self.key, "artifacts": counts,
                  "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                  "saved": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        write_bytes(self.bundle_path, data)
        write_json(self.record_path, record)
        self._held = keys
        self._info(f"CompileCache: saved {len(keys)} compile artifacts ({_by_kind(counts)}), {len(data) / 1e6:.1f} MB, "
                   f"to {self.bundle_path}")
        return record

    def _bundled(self) -> dict[str, list]:
        """The artifacts of the bundle now in the directory when it is this key's and its bytes match
        its record (another process may have written it since `load`), else none."""
        try:
            record = json.loads(self.record_path.read_text(encoding="utf-8"))
            data = self.bundle_path.read_bytes()
            if record.get("key") == self.key and hashlib.sha256(data).hexdigest() == record.get("sha256"):
                return _read_artifacts(data)
        except Exception:  # no bundle yet, or one that load() refused: nothing to keep
            pass
        return {}

    def _warn_public_only(self) -> None:
        self._warn(f"CompileCache: torch {torch.__version__} lacks the bundle serializer this class reads every "
                   "chunk with; torch's own loader keeps only the last save's artifacts of each kind")

    def _refuse(self, why: str) -> bool:
        self._warn(f"CompileCache: not loading the compile cache {self.bundle_path}: {why}; this run compiles "
                   "from scratch and replaces it")
        return False


def _by_kind(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
