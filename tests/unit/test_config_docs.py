"""docs/configuration.md is the generator's output, and the generator covers every setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec import configdoc, launch
from tests.support import ROOT

DOC = ROOT / "docs" / "configuration.md"


def test_configuration_reference_is_fresh() -> None:
    assert DOC.read_text(encoding="utf-8") == configdoc.render(), (
        f"docs/configuration.md is stale: run `{configdoc.REGENERATE}`"
    )


def test_reference_starts_with_the_regenerate_command() -> None:
    assert configdoc.REGENERATE in "\n".join(DOC.read_text(encoding="utf-8").splitlines()[:4])


def test_one_section_per_launched_process() -> None:
    commands = {p.command for p in configdoc.PROCESSES}
    assert commands == {f"python -m {module}" for module in launch.PROCESSES.values()}
    text = DOC.read_text(encoding="utf-8")
    for process in configdoc.PROCESSES:
        assert f"## {process.title}: `{process.command}`" in text


@pytest.mark.parametrize("process", configdoc.PROCESSES, ids=lambda p: p.command)
def test_every_field_has_a_row_with_its_default_and_meaning(process: configdoc.Process) -> None:
    cls = configdoc.load(process.settings)
    rows = {line.split(" | ")[0].strip("| `"): line for line in DOC.read_text(encoding="utf-8").splitlines()
            if line.startswith("| `")}
    prefix = configdoc.env_prefix(cls).upper()
    assert prefix.startswith("SPECDEC_")
    for name, field in cls.model_fields.items():
        row = rows.get(f"{prefix}{name.upper()}")
        assert row is not None, f"{prefix}{name.upper()} is missing"
        assert field.description and field.description.replace("|", "\\|") in row
        if field.default_factory is None and field.default is not None:
            assert f"`{str(field.default).lower() if isinstance(field.default, bool) else field.default}`" in row


def test_output_does_not_depend_on_this_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Defaults computed at run time (the cache folder) are described, never evaluated."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    text = configdoc.render()
    assert str(tmp_path) not in text
    assert str(Path.home()) not in text
    assert text == DOC.read_text(encoding="utf-8")


def test_values_and_bounds_are_rendered() -> None:
    from draft_service.settings import DraftSettings

    fields = DraftSettings.model_fields
    assert configdoc.describe_type(fields["backend"].annotation) == "one of `auto`, `native`, `llamacpp`, `transformers`, `ngram`"
    assert configdoc.describe_type(fields["metrics_port"].annotation) == "int or unset"
    assert configdoc.describe_constraints(fields["port"]) == "≥ 0, ≤ 65535"
    assert configdoc.describe_constraints(fields["kv_budget_mb"]) == "> 0"
    assert configdoc.describe_default(fields["metrics_port"]) == "`9101`"
    assert configdoc.describe_default(fields["cache_dir"]).startswith("`$SPECDEC_CACHE_DIR`")


def test_main_writes_or_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "configuration.md"
    assert configdoc.main(["-o", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == configdoc.render()
    assert configdoc.main([]) == 0
    assert capsys.readouterr().out == configdoc.render()
