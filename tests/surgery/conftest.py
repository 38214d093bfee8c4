import warnings

import pytest

from lightning_adaptiveload.surgery import core


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch):
    """Any fused-AdaLN fallback warning fails the test unless it expects one with pytest.warns: the
    tests must exercise the fused op itself. The warn-once memory is reset for each test."""
    monkeypatch.setattr(core, "_warned", set())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fused AdaLN", category=RuntimeWarning)
        yield
