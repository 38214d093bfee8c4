"""Checks shared by the tests of the JSON model documents (cost, depth cost and memory models)."""
import json

import pytest


def assert_rejected(read, tmp_path, doc, message: str) -> None:
    """`read(path)` of `doc` written to a file raises a ValueError matching `message` and naming the file."""
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message) as info:
        read(path)
    assert str(path) in str(info.value)
