"""``python -m specdec.prepare``: make the embedded default ready offline (convert it once to a
safetensors cache and check the draft GGUF is there), so the services start in about a second."""

from __future__ import annotations

import logging
import sys
import time

from specdec.models import default_cache_dir, embedded_gguf_path, resolve_hf

logger = logging.getLogger("specdec.prepare")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    gguf = embedded_gguf_path()
    folder = resolve_hf("embedded", default_cache_dir())
    logger.info("embedded default ready in %.1f s: draft %s, target %s", time.perf_counter() - t0, gguf, folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
