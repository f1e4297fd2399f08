"""``python -m specdec.configdoc [-o docs/configuration.md]``: the configuration reference.

Renders one table per process (every variable, its default and meaning) straight from the
pydantic-settings classes, so the reference cannot drift from the code: tests/unit/test_config_docs.py
fails when docs/configuration.md differs from this output. Defaults computed at run time (the
cache folder) are described, never evaluated, so the output is the same on every machine.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import annotated_types
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = ROOT / "docs" / "configuration.md"
REGENERATE = "python -m specdec.configdoc -o docs/configuration.md"


@dataclass(frozen=True)
class Process:
    title: str
    command: str
    settings: str  # "module:Class"
    flags: bool  # whether the command also takes every variable as a --flag


PROCESSES: tuple[Process, ...] = (
    Process("Draft service", "python -m draft_service", "draft_service.settings:DraftSettings", True),
    Process("Target service", "python -m target_service", "target_service.settings:TargetSettings", True),
    Process("Orchestrator", "python -m orchestrator", "orchestrator.settings:OrchestratorSettings", True),
    Process("Dashboard", "python -m ui", "ui.settings:UISettings", False),
)

# Read outside the settings classes (by the libraries, the cache default or the build script).
OTHER_VARIABLES: tuple[tuple[str, str], ...] = (
    ("SPECDEC_CACHE_DIR", "Default `cache_dir` of both model services: where the embedded model is converted "
                          "to safetensors (`python -m specdec.prepare`) and models are converted to GGUF for llama.cpp "
                          "(`gguf/`). Unset: `$XDG_CACHE_HOME/specdec`, "
                          "else `~/.cache/specdec`."),
    ("HF_HOME", "Hugging Face cache of downloaded models and tokenizers (default `~/.cache/huggingface`)."),
    ("HF_HUB_OFFLINE", "`1` loads hub ids from `HF_HOME` only, never from the network."),
    ("SPECDEC_HEALTHCHECK_TLS_CA_FILE", "`python -m specdec.healthcheck` (the container health check): check a model "
                                        "service over TLS, trusting this PEM CA. With `…_TLS_CERT_FILE` and "
                                        "`…_TLS_KEY_FILE` for mutual TLS, `…_TLS_SERVER_NAME` for the name in the "
                                        "service's certificate (docs/security.md)."),
    ("SPECDEC_LLAMACPP_CONVERTER", "Folder of llama.cpp's `convert_hf_to_gguf.py` (with `conversion/` and `gguf-py/`) "
                                   "that `specdec.model.gguf_convert` runs; default `<venv>/share/specdec/llama.cpp`, "
                                   "where `scripts/install_llamacpp.sh` keeps the one of the llama.cpp it builds."),
    ("SPECDEC_NATIVE", "`0` keeps specdec's runner on torch ops instead of its native C kernels (`specdec.native`: "
                       "norms, rotary, attention and the SwiGLU gate of Llama and GPT-2 models; ~2-4 ms a step "
                       "faster). Default `1`: compiled with `$CC` (else `cc`) on first use; without a compiler the "
                       "runner logs why and uses torch ops."),
    ("SPECDEC_NATIVE_DIR", "Folder of the compiled native kernels (default `<SPECDEC_CACHE_DIR>/native`); the container "
                           "image ships them prebuilt in `/opt/specdec/native`."),
    ("SPECDEC_LLAMACPP_AVX512", "`off` builds llama-cpp-python without AVX-512 in `scripts/install_llamacpp.sh` "
                                "(portable AVX2 build); default `auto` uses it where the CPU has it."),
)


def load(path: str) -> type[BaseSettings]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def env_prefix(cls: type[BaseSettings]) -> str:
    return cls.model_config.get("env_prefix", "")


def _code(value: object) -> str:
    return f"`{value}`"


def describe_default(field: FieldInfo) -> str:
    """The default as shown to a user; a factory is described by its docstring, not called."""
    if field.default_factory is not None:
        doc = inspect.getdoc(field.default_factory) or field.default_factory.__name__
        return doc.splitlines()[0].replace("``", "`").rstrip(".")
    if field.default is PydanticUndefined:
        return "required"
    if field.default is None:
        return "unset"
    if isinstance(field.default, bool):
        return _code(str(field.default).lower())
    if isinstance(field.default, int) and field.default >= 1 << 16 and field.default & (field.default - 1) == 0:
        return f"{_code(field.default)} (2^{field.default.bit_length() - 1})"
    return _code(field.default)


def describe_type(annotation: object) -> str:
    """A short name of the accepted values: ``float``, ``one of `a`, `b```, ``int or unset``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(_code(v) for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        inner = " or ".join(describe_type(a) for a in args)
        return f"{inner} or unset" if len(args) < len(typing.get_args(annotation)) else inner
    if isinstance(annotation, type):
        return {"str": "text", "Path": "path", "SecretStr": "secret text"}.get(annotation.__name__, annotation.__name__)
    return str(annotation)


def describe_constraints(field: FieldInfo) -> str:
    """Bounds declared with ``Field(ge=..., gt=..., le=..., lt=...)``, e.g. ``≥ 0, ≤ 65535``."""
    bounds = ((annotated_types.Ge, "ge", "≥"), (annotated_types.Gt, "gt", ">"),
              (annotated_types.Le, "le", "≤"), (annotated_types.Lt, "lt", "<"))
    parts = []
    for item in field.metadata:
        for kind, attr, symbol in bounds:
            if isinstance(item, kind):
                parts.append(f"{symbol} {getattr(item, attr)}")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(cls: type[BaseSettings]) -> list[str]:
    """Markdown rows: variable, default, accepted values, meaning; in field order."""
    rows = ["| Variable | Default | Values | Meaning |", "| --- | --- | --- | --- |"]
    prefix = env_prefix(cls).upper()
    for name, field in cls.model_fields.items():
        values = describe_type(field.annotation)
        if constraints := describe_constraints(field):
            values = f"{values}, {constraints}"
        rows.append(
            f"| `{prefix}{name.upper()}` | {_cell(describe_default(field))} | {_cell(values)} "
            f"| {_cell(field.description or '')} |"
        )
    return rows


def render() -> str:
    """The whole of docs/configuration.md."""
    lines = [
        "# Configuration reference",
        "",
        f"Generated from the pydantic-settings classes; do not edit by hand. Regenerate with `{REGENERATE}`",
        "(tests/unit/test_config_docs.py fails when this file is stale).",
        "",
        "Every process reads its settings from environment variables with its own prefix; the model",
        "services and the orchestrator also take each one as a command-line flag named after the field",
        "(`SPECDEC_DRAFT_KV_BUDGET_MB=512` is `python -m draft_service --kv_budget_mb 512`), and a flag",
        "wins over a variable. Names are case-insensitive. docs/docker.md lists the variables that",
        "compose.yaml itself reads.",
        "",
    ]
    for process in PROCESSES:
        cls = load(process.settings)
        lines += [f"## {process.title}: `{process.command}`", ""]
        doc = (inspect.getdoc(cls) or "").strip().replace("``", "`")
        intro = f"{doc} " if doc else ""
        intro += f"Variables start with `{env_prefix(cls)}`"
        intro += "; each is also a flag." if process.flags else "."
        lines += [intro, "", *table(cls), ""]
    lines += ["## Other variables", "", "| Variable | Meaning |", "| --- | --- |"]
    lines += [f"| `{name}` | {_cell(meaning)} |" for name, meaning in OTHER_VARIABLES]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.configdoc", description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, help=f"write here (e.g. {DEFAULT_OUTPUT.relative_to(ROOT)}) "
                                                          "instead of printing")
    args = parser.parse_args(argv)
    text = render()
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
