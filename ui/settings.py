"""Dashboard configuration: SPECDEC_UI_* variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class UISettings(BaseSettings):
    """Where the dashboard listens and which orchestrator it watches."""

    model_config = SettingsConfigDict(env_prefix="SPECDEC_UI_")

    orchestrator_url: str = Field("http://localhost:8000", description="Base URL of the orchestrator's HTTP API.")
    host: str = Field(
        "127.0.0.1", description="Interface the dashboard listens on (0.0.0.0: every interface, as in the containers)."
    )
    port: int = Field(8501, ge=1, le=65535, description="Port the dashboard (Streamlit) listens on.")
    api_key: SecretStr | None = Field(
        None, description="API key sent to the orchestrator as `Authorization: Bearer <key>` (its api_keys)."
    )
    api_key_file: Path | None = Field(None, description="File holding api_key (a mounted secret); wins over api_key.")
    password: SecretStr | None = Field(
        None, description="Ask every browser session for this password before showing anything (the dashboard "
                          "generates with api_key: without a password, whoever reaches its port uses the key).",
    )
    password_file: Path | None = Field(None, description="File holding password (a mounted secret); wins over password.")
    request_timeout_s: float = Field(5.0, gt=0, description="Deadline of the health, readiness and info calls.")
    stream_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait for the next event of a generation (the first includes one step)."
    )
    health_interval_s: float = Field(5.0, gt=0, description="How often the service panel refreshes itself.")

    def orchestrator_key(self) -> str | None:
        """The API key from api_key_file or else api_key; None when neither is set (an open API)."""
        if self.api_key_file is not None:
            return self.api_key_file.read_text(encoding="utf-8").strip() or None
        return (self.api_key.get_secret_value().strip() or None) if self.api_key else None

    def dashboard_password(self) -> str | None:
        """The password from password_file or else password; None when neither is set (no login)."""
        if self.password_file is not None:
            return self.password_file.read_text(encoding="utf-8").strip() or None
        return (self.password.get_secret_value().strip() or None) if self.password else None
