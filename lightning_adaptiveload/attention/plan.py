"""The attention plan: per bucket (seq_len), the backend its steps run and what every backend measured.

Pure data, JSON in and out (the conventions of scheduling/model_io.py: a "format" and "version"
header, errors naming the file or `where` and the field). docs/attention.md describes the format.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from types import MappingProxyType

from lightning_adaptiveload._validation import is_finite_number, require_int
from lightning_adaptiveload.scheduling.model_io import JsonDocument, check_header

FORMAT = "adaptiveload-attention-plan"
VERSION = 1


def _optional_number(where: str, name: str, value) -> float | None:
    if value is None:
        return None
    if not is_finite_number(value) or value < 0:
        raise ValueError(f"{where}: '{name}' must be a finite number >= 0 or null, got {value!r}")
    return float(value)


def _optional_str(where: str, name: str, value) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}: '{name}' must be a string or null, got {value!r}")
    return value


@dataclass(frozen=True)
class BackendResult:
    """One backend on one bucket's calls.

    ms: forward+backward of every call of a step, summed with the calls' counts (milliseconds),
    None where it did not run; error: why it did not run or was rejected (its refusal, an exception,
    a tolerance exceeded), None if nothing went wrong; max_rel_err: its largest relative error
    (output, dq, dk, dv) against the fp32 reference, None where not checked; tolerance: the bound
    that error was held to."""

    backend: str
    ms: float | None = None
    error: str | None = None
    max_rel_err: float | None = None
    tolerance: float | None = None

    def __post_init__(self):
        where = f"backend result {self.backend!r}"
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"backend result: 'backend' must be a backend name, got {self.backend!r}")
        for name in ("ms", "max_rel_err", "tolerance"):
            object.__setattr__(self, name, _optional_number(where, name, getattr(self, name)))
        _optional_str(where, "error", self.error)
        if (self.max_rel_err is None) != (self.tolerance is None):
            raise ValueError(f"{where}: 'max_rel_err' and 'tolerance' are given together or not at all")

    @property
    def checked(self) -> bool:
        return self.max_rel_err is not None

    @property
    def correct(self) -> bool | None:
        """Within tolerance of the reference; None where not checked."""
        return None if not self.checked else self.max_rel_err <= self.tolerance

    @property
    def usable(self) -> bool:
        """It ran, and was not found wrong."""
        return self.ms is not None and self.correct is not False and self.error is None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc, where: str) -> "BackendResult":
        if not isinstance(doc, Mapping):
            raise ValueError(f"{where}: must be an object, got {type(doc).__name__}")
        names = {f.name for f in fields(cls)}
        if set(doc) != names:
            raise ValueError(f"{where}: keys must be {sorted(names)}, got {sorted(doc)}")
        try:
            return cls(**doc)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e


@dataclass(frozen=True)
class BucketAttention:
    """One bucket: seq_len (tokens per sample), batch_size measured, backend chosen (None: torch's
    own choice, e.g. when no candidate ran), torch_default: the kernel torch picks by itself for the
    bucket's calls ("flash", or "flash+efficient" when its calls differ), results: every backend's."""

    seq_len: int
    batch_size: int
    backend: str | None
    torch_default: str | None
    results: tuple[BackendResult, ...]

    def __post_init__(self):
        require_int("seq_len", self.seq_len)
        require_int("batch_size", self.batch_size)
        object.__setattr__(self, "results", tuple(self.results))
        names = [r.backend for r in self.results]
        if len(set(names)) != len(names):
            raise ValueError(f"bucket {self.seq_len}: a backend is listed twice in {names}")
        if self.backend is not None:
            chosen = {r.backend: r for r in self.results}.get(self.backend)
            if chosen is None or not chosen.usable:
                raise ValueError(f"bucket {self.seq_len}: backend {self.backend!r} is not among its results that "
                                 f"ran correctly ({[r.backend for r in self.results if r.usable]})")

    def result(self, backend: str) -> BackendResult | None:
        return next((r for r in self.results if r.backend == backend), None)

    def to_dict(self) -> dict:
        return {"seq_len": self.seq_len, "batch_size": self.batch_size, "backend": self.backend,
                "torch_default": self.torch_default, "results": [r.to_dict() for r in self.results]}

    @classmethod
    def from_dict(cls, doc, where: str) -> "BucketAttention":
        keys = {"seq_len", "batch_size", "backend", "torch_default", "results"}
        if not isinstance(doc, Mapping) or set(doc) != keys:
            got = sorted(doc) if isinstance(doc, Mapping) else type(doc).__name__
            raise ValueError(f"{where}: must be an object with keys {sorted(keys)}, got {got}")
        if not isinstance(doc["results"], list):
            raise ValueError(f"{where}: 'results' must be a list")
        results = [BackendResult.from_dict(r, f"{where}: results[{i}]") for i, r in enumerate(doc["results"])]
        _optional_str(where, "backend", doc["backend"])
        _optional_str(where, "torch_default", doc["torch_default"])
        try:
            return cls(doc["seq_len"], doc["batch_size"], doc["backend"], doc["torch_default"], results)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e


@dataclass(frozen=True, eq=False)
class AttentionPlan(JsonDocument):
    """Per bucket seq_len -> BucketAttention; device and torch_version it was measured with (a plan
    is only valid there: calibration keys its cache on both)."""

    buckets: Mapping[int, BucketAttention]
    device: str | None = None
    torch_version: str | None = None

    def __post_init__(self):
        buckets = dict(self.buckets)
        for seq_len, bucket in buckets.items():
            if not isinstance(bucket, BucketAttention) or bucket.seq_len != seq_len:
                raise ValueError(f"buckets must map seq_len -> its BucketAttention (key {seq_len!r})")
        object.__setattr__(self, "buckets", MappingProxyType(dict(sorted(buckets.items()))))

    @classmethod
    def of(cls, buckets: Iterable[BucketAttention], device: str | None = None,
           torch_version: str | None = None) -> "AttentionPlan":
        return cls({b.seq_len: b for b in buckets}, device, torch_version)

    def backend_for(self, seq_len: int) -> str | None:
        """The backend of bucket `seq_len`; None (torch's own choice) for a bucket the plan has not
        measured or where no candidate ran."""
        bucket = self.buckets.get(int(seq_len))
        return None if bucket is None else bucket.backend

    def backends_used(self) -> set[str | None]:
        """The distinct backends of the plan's buckets (None: torch's own choice); a compiled region
        builds one graph per entry (backends.py)."""
        return {b.backend for b in self.buckets.values()}

    def format(self) -> str:
        """A table: per bucket, the choice, torch's own pick and every backend's ms (or why not)."""
        names = sorted({r.backend for b in self.buckets.values() for r in b.results})
        lines = [f"{'seq_len':>8} {'B':>4} {'chosen':>9} {'torch':>9} " + " ".join(f"{n + ' ms':>14}" for n in names)]
        for b in self.buckets.values():
            cells = []
            for name in names:
                r = b.result(name)
                if r is None:
                    cells.append(f"{'-':>14}")
                elif r.ms is None or not r.usable:
                    cells.append(f"{'failed' if r.ms is None else 'wrong':>14}")
                else:
                    cells.append(f"{r.ms:>14.3f}")
            lines.append(f"{b.seq_len:>8} {b.batch_size:>4} {str(b.backend):>9} {str(b.torch_default):>9} "
                         + " ".join(cells))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "device": self.device, "torch_version": self.torch_version,
                "buckets": [b.to_dict() for b in self.buckets.values()]}

    @classmethod
    def from_dict(cls, doc, where: str = "attention plan") -> "AttentionPlan":
        """The plan of a `to_dict` document; ValueError naming `where` and the field for anything malformed."""
        check_header(doc, where, FORMAT, VERSION, ("device", "torch_version", "buckets"))
        _optional_str(where, "device", doc["device"])
        _optional_str(where, "torch_version", doc["torch_version"])
        if not isinstance(doc["buckets"], list):
            raise ValueError(f"{where}: 'buckets' must be a list, got {type(doc['buckets']).__name__}")
        buckets = [BucketAttention.from_dict(b, f"{where}: buckets[{i}]") for i, b in enumerate(doc["buckets"])]
        seq_lens = [b.seq_len for b in buckets]
        if len(set(seq_lens)) != len(seq_lens):
            raise ValueError(f"{where}: 'buckets' lists a seq_len twice ({sorted(seq_lens)})")
        return cls.of(buckets, doc["device"], doc["torch_version"])
