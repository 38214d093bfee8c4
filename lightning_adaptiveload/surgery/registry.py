"""Which patterns `apply_fused_adaln` uses: the registered ones (built-ins and any a user adds with
`register_adaln_patterns`) and per-call extras, given as AdaLNPattern objects or import paths."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Union

from lightning_adaptiveload._imports import import_object
from lightning_adaptiveload.surgery.core import AdaLNPattern

PatternSpec = Union[AdaLNPattern, str, Iterable["PatternSpec"]]

_REGISTRY: dict[str, AdaLNPattern] = {}


def resolve_patterns(spec: PatternSpec | None) -> list[AdaLNPattern]:
    """Patterns from an AdaLNPattern, an import path string naming a pattern or a list of them
    (e.g. "examples.video_dit.surgery.VIDEO_DIT_PATTERNS"), or an iterable of those; in order,
    without repeats of the same object."""
    if spec is None:
        return []
    if isinstance(spec, str):
        resolved = import_object(spec, "AdaLN pattern path")
        if isinstance(resolved, str) or not isinstance(resolved, (AdaLNPattern, Iterable)):
            raise TypeError(f"AdaLN pattern path {spec!r} names a {type(resolved).__name__}, not an AdaLNPattern or a list of them")
        return resolve_patterns(resolved)
    if isinstance(spec, AdaLNPattern):
        return [spec]
    if not isinstance(spec, Iterable):
        raise TypeError(f"expected an AdaLNPattern, an import path or an iterable of those, got {type(spec).__name__}")
    out: list[AdaLNPattern] = []
    for item in spec:
        for pattern in resolve_patterns(item):
            if not any(pattern is p for p in out):
                out.append(pattern)
    return out


def merge_patterns(first: list[AdaLNPattern], then: list[AdaLNPattern]) -> list[AdaLNPattern]:
    """`first` followed by the patterns of `then` not already in it; two different patterns with
    one name are an error (a name selects one pattern)."""
    by_name = {p.name: p for p in first}
    out = list(first)
    for pattern in then:
        known = by_name.get(pattern.name)
        if known is None:
            by_name[pattern.name] = pattern
            out.append(pattern)
        elif known is not pattern:
            raise ValueError(f"two different AdaLN patterns are named {pattern.name!r}; give one another name")
    return out


def register_adaln_patterns(*patterns: PatternSpec) -> list[str]:
    """Add patterns to those every later `apply_fused_adaln` / `FusedAdaLNSurgery` uses.

    Takes AdaLNPattern objects, import paths ("pkg.module.PATTERNS") or iterables of them.
    Registering the same object again is a no-op; another pattern under a registered name raises
    ValueError. Returns the names registered by this call.
    """
    merged = merge_patterns(list(_REGISTRY.values()), resolve_patterns(patterns))
    added = [p.name for p in merged if p.name not in _REGISTRY]
    _REGISTRY.clear()
    _REGISTRY.update((p.name, p) for p in merged)
    return added


def registered_patterns() -> list[AdaLNPattern]:
    """The registered patterns, in registration order (built-ins first)."""
    return list(_REGISTRY.values())
