"""``python -m specdec serve MODEL [--draft DRAFT] …``: serve a model in one line.

Starts the target service on MODEL, the draft service on DRAFT and the orchestrator (the dashboard
too with ``--ui``) on this machine, as ``python -m specdec.launch`` does, with the flags turned into
the services' settings (docs/configuration.md). Flags follow vLLM's spellings, with llama.cpp's
server's as aliases where it has one::

    python -m specdec serve embedded
    python -m specdec serve gpt2 --draft distilgpt2 --port 8080 --api-key sk-local
    python -m specdec serve ./SmolLM2-360M-Instruct --quantization q8_0 --draft embedded

Without ``--draft`` the embedded model drafts for itself, and any other model drafts for itself from
a quantised copy (``SPECDEC_DRAFT_MODEL=target``): a draft that always shares the tokenizer.
Settings in the environment (SPECDEC_*) still apply; a flag given wins over them.
"""

from __future__ import annotations

import argparse
import os
import sys

from specdec.model.gguf_convert import QUANTS


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m specdec", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve MODEL with a draft (target + draft + orchestrator)",
                           description=__doc__.split("\n\n")[1])
    serve.add_argument("model", help="the target: a Hugging Face id, a checkpoint folder, a .gguf file, or embedded")
    serve.add_argument("--draft", "--speculative-model", "-md", dest="draft",
                       help="the draft: an id, a folder or a .gguf file; 'target' for the target itself quantised "
                            "(default: embedded for the embedded target, else target)")
    serve.add_argument("--quantization", "-q", choices=QUANTS,
                       help="compute the target from a GGUF copy of this type (default: its own dtype)")
    serve.add_argument("--draft-quantization", choices=QUANTS, help="the GGUF type of a converted draft")
    serve.add_argument("--host", help="the HTTP API's address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="the HTTP API's port (default 8000)")
    serve.add_argument("--api-key", action="append", help="require this key (repeat for several)")
    serve.add_argument("--served-model-name", help="the model name /v1/models reports")
    serve.add_argument("--num-speculative-tokens", "--draft-max", dest="max_k", type=int,
                       help="the largest draft an adaptive controller may pick (default 16)")
    serve.add_argument("--max-tokens-limit", type=int, help="the most tokens one request may generate")
    serve.add_argument("--ui", action="store_true", help="start the dashboard too (port 8501)")
    return ap


def environment(args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the settings the flags give (a flag wins over the environment)."""
    draft = args.draft or env.get("SPECDEC_DRAFT_MODEL") or ("embedded" if args.model == "embedded" else "target")
    flags = {
        "SPECDEC_PAIR": "embedded",
        "SPECDEC_TARGET_MODEL": args.model,
        "SPECDEC_DRAFT_MODEL": draft,
        "SPECDEC_DRAFT_TARGET_MODEL": args.model,
        "SPECDEC_TARGET_QUANT": args.quantization,
        "SPECDEC_DRAFT_QUANT": args.draft_quantization,
        "SPECDEC_ORCHESTRATOR_HOST": args.host,
        "SPECDEC_ORCHESTRATOR_PORT": str(args.port) if args.port is not None else None,
        "SPECDEC_ORCHESTRATOR_API_KEYS": ",".join(args.api_key) if args.api_key else None,
        "SPECDEC_ORCHESTRATOR_MODEL_NAME": args.served_model_name,
        "SPECDEC_ORCHESTRATOR_DEFAULT_MAX_K": str(args.max_k) if args.max_k is not None else None,
        "SPECDEC_ORCHESTRATOR_MAX_TOKENS_LIMIT": str(args.max_tokens_limit) if args.max_tokens_limit else None,
    }
    return {**env, **{k: v for k, v in flags.items() if v is not None}}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from specdec import launch

    os.environ.update(environment(args, dict(os.environ)))
    only = ["draft", "target", "orchestrator"] + (["ui"] if args.ui else [])
    return launch.main(["--only", *only])


if __name__ == "__main__":
    sys.exit(main())
