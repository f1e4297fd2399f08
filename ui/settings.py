"""Dashboard configuration: SPECDEC_UI_* variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class UISettings(BaseSettings):
    """Where the dashboard listens and which orchestrator it watches."""

    model_config = SettingsConfigDict(env_prefix="SPECDEC_UI_")

    orchestrator_url: str = Field("http://localhost:8000", description="Base URL of the orchestrator's HTTP API.")
    port: int = Field(8501, ge=1, le=65535, description="Port the dashboard (Streamlit) listens on.")
    request_timeout_s: float = Field(5.0, gt=0, description="Deadline of the health, readiness and info calls.")
    stream_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait for the next event of a generation (the first includes one step)."
    )
    health_interval_s: float = Field(5.0, gt=0, description="How often the service panel refreshes itself.")
