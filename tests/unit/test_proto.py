"""The committed stubs are what `make proto` generates from proto/ today."""

from __future__ import annotations

from pathlib import Path

from specdec import codegen
from specdec.v1 import specdec_pb2 as pb


def test_generated_stubs_are_fresh(tmp_path):
    written = codegen.generate(tmp_path)
    assert written
    for path in written:
        committed = codegen.ROOT / path.relative_to(tmp_path)
        assert committed.is_file(), f"{committed} missing: run `make proto`"
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run `make proto`"


def test_every_field_is_commented():
    """The contract documents every message field (comments sit on the line(s) above)."""
    text = (codegen.PROTO_DIR / "specdec/v1/specdec.proto").read_text().splitlines()
    for i, line in enumerate(text):
        stripped = line.strip()
        if stripped.endswith(";") and "=" in stripped and not stripped.startswith(("option", "syntax", "package")):
            assert text[i - 1].strip().startswith("//"), f"line {i + 1} has no comment: {stripped}"
    assert pb.DESCRIPTOR.package == "specdec.v1"
    assert Path(pb.__file__).parent.name == "v1"
