"""The attention calls of any (B, S) from the calls recorded at two probe batches.

Every integer of a call (each shape and stride entry) is taken to be a monomial c * B^i * S^j with
i in {0, 1} and j in {0, 1, 2}: heads and head dim are constant (c), the sequence dim of
self-attention is S, its batch stride S*h*d, cross-attention's key length L_text is constant, a
mask's S x S stride grows as S^2. Two probes (B1, S1) and (B2, S2) fix each entry's exponents
exactly when the six ratios (B2/B1)^i (S2/S1)^j are distinct, which `CallTemplate.from_probes`
checks. Anything else (a probe whose calls do not pair up, an entry no monomial explains, such as
S + 1 for a register token, or a flag that differs) is a `TemplateError`: the caller then records
that bucket directly.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from itertools import product

from lightning_adaptiveload._validation import require_int
from lightning_adaptiveload.attention.calls import SdpaCall

_EXPONENTS = tuple(product((0, 1), (0, 1, 2)))  # (i, j) of B^i S^j
_INT_FIELDS = ("q_shape", "q_stride", "k_shape", "k_stride", "v_shape", "v_stride", "mask_shape", "mask_stride")


class TemplateError(ValueError):
    """The probes do not determine the calls of other (B, S): probe the bucket directly."""


@dataclass(frozen=True)
class Probe:
    """The calls recorded for one batch of batch_size samples of seq_len tokens each."""

    batch_size: int
    seq_len: int
    calls: tuple[SdpaCall, ...]

    def __post_init__(self):
        require_int("Probe.batch_size", self.batch_size)
        require_int("Probe.seq_len", self.seq_len)
        object.__setattr__(self, "calls", tuple(self.calls))
        if not all(isinstance(c, SdpaCall) for c in self.calls):
            raise ValueError("Probe.calls must be SdpaCalls (record_sdpa_calls gives them)")


@dataclass(frozen=True)
class _Term:
    """c * B^i * S^j."""

    c: Fraction
    i: int
    j: int

    def at(self, batch_size: int, seq_len: int, where: str) -> int:
        value = self.c * batch_size ** self.i * seq_len ** self.j
        if value.denominator != 1:
            raise TemplateError(f"{where} is {value} at B={batch_size}, S={seq_len}: not an integer")
        return int(value)


def _fit_term(v1: int, v2: int, p1: Probe, p2: Probe, where: str) -> _Term:
    if v1 == v2 == 0:
        return _Term(Fraction(0), 0, 0)
    for i, j in _EXPONENTS:
        d1, d2 = p1.batch_size ** i * p1.seq_len ** j, p2.batch_size ** i * p2.seq_len ** j
        if v1 * d2 == v2 * d1:  # the same coefficient at both probes
            return _Term(Fraction(v1, d1), i, j)
    raise TemplateError(f"{where} is {v1} at (B={p1.batch_size}, S={p1.seq_len}) and {v2} at "
                        f"(B={p2.batch_size}, S={p2.seq_len}): not c * B^i * S^j (i <= 1, j <= 2)")


@dataclass(frozen=True)
class _CallTemplate:
    call: SdpaCall  # the first probe's call: its flags, dtype, count
    terms: dict  # field -> tuple[_Term, ...] (None where the call has no mask)

    def at(self, batch_size: int, seq_len: int, where: str) -> SdpaCall:
        values = {name: None if terms is None else tuple(t.at(batch_size, seq_len, f"{where} {name}[{n}]")
                                                         for n, t in enumerate(terms))
                  for name, terms in self.terms.items()}
        return replace(self.call, **values)


class CallTemplate:
    """The calls of a step at any (B, S), from two probes; `instantiate(B, S) -> list[SdpaCall]`."""

    def __init__(self, calls: Sequence[_CallTemplate], probes: tuple[Probe, Probe]):
        self._calls = tuple(calls)
        self.probes = probes

    @classmethod
    def from_probes(cls, first: Probe, second: Probe) -> "CallTemplate":
        """The template of two probes; TemplateError saying why when they do not determine one.

        The probes must differ in B and in S with the six ratios (B2/B1)^i (S2/S1)^j distinct (e.g.
        B = 2 and 3 at S = 256 and 1,024 gives 1, 4, 16, 1.5, 6, 24), and make the same calls in the same
        order with the same counts and flags."""
        rb, rs = Fraction(second.batch_size, first.batch_size), Fraction(second.seq_len, first.seq_len)
        ratios = [rb ** i * rs ** j for i, j in _EXPONENTS]
        if len(set(ratios)) != len(ratios):
            raise TemplateError(f"probes (B={first.batch_size}, S={first.seq_len}) and (B={second.batch_size}, "
                                f"S={second.seq_len}) cannot tell B from S: B must differ, S must differ, and "
                                f"(B2/B1)^i (S2/S1)^j must be distinct for i <= 1, j <= 2 (e.g. B = 2, 3 at S = 256, 1024)")
        if len(first.calls) != len(second.calls):
            raise TemplateError(f"the probe at S={first.seq_len} made {len(first.calls)} distinct attention calls, "
                                f"the one at S={second.seq_len} {len(second.calls)}")
        templates = []
        for n, (a, b) in enumerate(zip(first.calls, second.calls)):
            where = f"attention call {n}"
            fixed = [f.name for f in fields(SdpaCall) if f.name not in _INT_FIELDS and getattr(a, f.name) != getattr(b, f.name)]
            if fixed:
                raise TemplateError(f"{where} differs in {fixed} between the probes")
            terms = {}
            for name in _INT_FIELDS:
                va, vb = getattr(a, name), getattr(b, name)
                if va is None:
                    terms[name] = None
                    continue
                if vb is None or len(va) != len(vb):
                    raise TemplateError(f"{where} {name} is {va} in one probe and {vb} in the other")
                terms[name] = tuple(_fit_term(x, y, first, second, f"{where} {name}[{i}]")
                                    for i, (x, y) in enumerate(zip(va, vb)))
            templates.append(_CallTemplate(a, terms))
        template = cls(templates, (first, second))
        for probe in (first, second):  # each entry fits on its own; together they must give the probes back
            if [c.key for c in template.instantiate(probe.batch_size, probe.seq_len)] != [c.key for c in probe.calls]:
                raise TemplateError(f"the template does not reproduce the probe at S={probe.seq_len}")
        return template

    def instantiate(self, batch_size: int, seq_len: int) -> list[SdpaCall]:
        """The calls (with counts) of a step of batch_size samples of seq_len tokens."""
        require_int("batch_size", batch_size)
        require_int("seq_len", seq_len)
        return [t.at(batch_size, seq_len, f"attention call {n}") for n, t in enumerate(self._calls)]
