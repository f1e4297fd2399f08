"""SHA-256 records of cached build and conversion outputs (``<file>.sha256``, as ``sha256sum``
writes it): written from the temporary file before it is renamed into place, checked before a
cached file is reused. Standard library only: the GGUF quantiser's child process imports it."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def file_sha256(path: Path) -> str:
    """The SHA-256 of ``path``'s bytes (hex), read 1 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def sidecar(path: Path) -> Path:
    """Where the SHA-256 of ``path`` is recorded: ``<path>.sha256``."""
    return path.with_name(path.name + ".sha256")


def process_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def record_sha256(path: Path, digest: str) -> None:
    """Write ``path``'s record holding ``digest``, beside it and renamed into place (never
    half-written), readable by everyone the umask allows: the image writes caches as root that
    the services' user reads."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".sha256", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{digest}  {path.name}\n")
        os.chmod(tmp, 0o644 & ~process_umask())  # mkstemp's file is its owner's only
        os.replace(tmp, sidecar(path))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def mismatch(path: Path) -> str | None:
    """Why ``path`` does not match its record (none, unreadable, another hash), or None when it does."""
    record = sidecar(path)
    try:
        recorded = record.read_text(errors="replace").split()[:1]
    except FileNotFoundError:
        return f"no {record.name}"
    except OSError as exc:
        return f"cannot read {record.name}: {exc}"
    actual = file_sha256(path)
    if recorded != [actual]:
        return f"its SHA-256 {actual[:16]}... is not the recorded {(recorded or ['nothing'])[0][:16]}..."
    return None
