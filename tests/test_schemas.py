"""The response schema documents every figure the loop reports, under the same names."""

from __future__ import annotations

from orchestrator.loop import GenerationStats
from orchestrator.schemas import GenerateResponse, GenerationStatsOut


def test_stats_schema_names_every_figure_of_the_loop():
    stats = GenerationStats(tokens=10, iterations=4, proposed=9, accepted=6, elapsed_ms=100.0).to_dict()
    assert set(stats) == set(GenerationStatsOut.model_fields)
    assert GenerationStatsOut.model_validate(stats).model_dump() == stats
    schema = GenerateResponse.model_json_schema()
    assert schema["properties"]["stats"] == {"$ref": "#/$defs/GenerationStatsOut"}
