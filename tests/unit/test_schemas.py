"""The response schema documents every figure the loop reports, under the same names."""

from __future__ import annotations

import pytest

from orchestrator.schemas import GenerateResponse, GenerationStatsOut
from orchestrator.step_accounting import GenerationStats


def test_stats_schema_names_every_figure_of_the_loop():
    stats = GenerationStats(tokens=10, iterations=4, proposed=9, accepted=6, elapsed_ms=100.0).to_dict()
    assert set(stats) == set(GenerationStatsOut.model_fields)
    assert GenerationStatsOut.model_validate(stats).model_dump() == stats
    schema = GenerateResponse.model_json_schema()
    assert schema["properties"]["stats"] == {"$ref": "#/$defs/GenerationStatsOut"}


def test_a_step_reads_the_same_in_every_consumer():
    """One step type from the loop to every reader: the dashboard and the benchmarks read the
    names ``Step`` dumps (a field renamed on one side only fails here)."""
    from evaluation.bench import position_counts
    from evaluation.load import step_record
    from orchestrator.schemas import Step
    from tests.support import step_json
    from ui import render

    data = step_json([5, 6, 7], 2, 9, index=3, k=4, tokens=[5, 6, 9], batch_sessions=2, batch_rows=9,
                     token_texts=["a", "b", "c"], next_token_text="d")
    assert Step.model_validate(data).model_dump(mode="json") == data
    assert (data["correction"], data["bonus"]) == (9, None)
    assert [(t.text, t.kind) for t in render.step_tokens(data)] == [
        ("a", "accepted"), ("b", "accepted"), ("c", "rejected"), ("d", "correction")]
    row = render.iteration_rows([data])[0]
    assert (row["k"], row["drafted"], row["accepted"], row["tokens"], row["next"]) == (4, 3, 2, 3, "correction")
    assert render.step_ms(data) == pytest.approx(data["draft_ms"] + data["verify_ms"] + data["overhead_ms"])
    assert step_record(1.5, data) == {"t": 1.5, "n": 3, "k": 4, "drafted": 3, "accepted": 2, "batch_sessions": 2,
                                      "batch_rows": 9}
    assert position_counts([data]) == {"drafted": [1, 1, 1], "accepted": [1, 1, 0]}


def test_the_step_is_typed_in_the_openapi_schema():
    from orchestrator.app import create_app
    from orchestrator.settings import OrchestratorSettings

    schema = create_app(OrchestratorSettings()).openapi()["components"]["schemas"]
    steps = schema["GenerateResponse"]["properties"]["steps"]["items"]
    assert steps == {"$ref": "#/components/schemas/Step"}
    assert {"next_token", "next_kind", "correction", "bonus", "token_texts"} <= set(schema["Step"]["properties"])
    assert schema["GenerateResponse"]["properties"]["stats"] == {"$ref": "#/components/schemas/GenerationStatsOut"}
