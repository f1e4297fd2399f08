"""The native library and the converted GGUF files are reused from their caches only when their
SHA-256 equals the one recorded beside them at write time (and, for the library, when no other
user could have written it): real builds and real conversions, tampered with on disk."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import pytest

import specdec.native as native_mod
from specdec.model import gguf_convert
from specdec.native import Kernels, build
from tests.support import make_bpe_model


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _record(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """One real build (~15 s), copied into each test's own folder by :func:`library`."""
    return build(tmp_path_factory.mktemp("native"))


@pytest.fixture
def library(built, tmp_path) -> Path:
    folder = tmp_path / "native"
    folder.mkdir()
    for p in built.parent.glob(built.name + "*"):  # the library and its record
        shutil.copy2(p, folder / p.name)
    return folder / built.name


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_build_records_its_hash_and_is_reused_unchanged(built):
    """The sidecar holds the library's SHA-256 as sha256sum writes it; a second call loads the
    same file (same inode and mtime), no rebuild."""
    assert _record(built).read_text() == f"{_sha256(built)}  {built.name}\n"
    before = built.stat()
    assert build(built.parent) == built
    after = built.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert before.st_mode & 0o022 == 0 and _record(built).stat().st_mode & 0o022 == 0


@pytest.mark.slow
def test_a_tampered_library_is_rebuilt_not_loaded(library, caplog):
    _flip_a_byte(library)
    tampered = library.stat().st_ino
    with caplog.at_level(logging.WARNING, logger="specdec.native"):
        assert build(library.parent) == library
    assert any(str(library) in r.getMessage() and "SHA-256" in r.getMessage() for r in caplog.records)
    assert library.stat().st_ino != tampered  # a fresh file, renamed into place
    assert _record(library).read_text().split()[0] == _sha256(library)
    assert Kernels(library).isa in ("avx512", "avx2", "baseline")


@pytest.mark.slow
def test_a_library_without_its_record_is_rebuilt(library, caplog):
    """No sidecar: the file is not re-hashed and trusted (whoever removed the record may have
    replaced the file), it is built again, with a new record."""
    _record(library).unlink(missing_ok=True)
    old = library.stat().st_ino
    with caplog.at_level(logging.WARNING, logger="specdec.native"):
        assert build(library.parent) == library
    assert any(str(library) in r.getMessage() and "no " in r.getMessage() for r in caplog.records)
    assert library.stat().st_ino != old
    assert _record(library).read_text().split()[0] == _sha256(library)


def test_a_library_others_could_write_is_refused(library, caplog, monkeypatch):
    """Group- or world-writable: never loaded even with a matching hash (without a compiler the
    build fails rather than return it, and the runner keeps its torch ops)."""
    library.chmod(0o775)
    monkeypatch.setenv("CC", "no-such-cc-here")
    with caplog.at_level(logging.WARNING, logger="specdec.native"), pytest.raises(native_mod.NativeError):
        build(library.parent)
    assert any(str(library) in r.getMessage() and "writable by group or others" in r.getMessage()
               for r in caplog.records)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_library_owned_by_another_user_is_refused(library):
    library.chmod(0o755)
    os.chown(library, 12345, 12345)
    assert build(library.parent) == library and library.stat().st_uid == os.geteuid()  # a fresh file
    assert _record(library).read_text().split()[0] == _sha256(library)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_bpe_model(tmp_path_factory.mktemp("bpe") / "gpt2", "gpt2")


@pytest.mark.slow
def test_a_tampered_gguf_is_converted_again(tiny_model, tmp_path, caplog):
    """A real conversion (~5 s) records its hash; an untouched file is reused as is; a flipped
    byte, or a missing record, converts again into a file that matches its record."""
    cache = tmp_path / "cache"
    out = gguf_convert.ensure_gguf(str(tiny_model), "f16", cache)
    record = _record(out)
    assert record.read_text() == f"{_sha256(out)}  {out.name}\n"
    first = out.stat()
    assert gguf_convert.ensure_gguf(str(tiny_model), "f16", cache) == out
    assert (out.stat().st_ino, out.stat().st_mtime_ns) == (first.st_ino, first.st_mtime_ns)

    _flip_a_byte(out)
    with caplog.at_level(logging.WARNING, logger="specdec.model.gguf_convert"):
        assert gguf_convert.ensure_gguf(str(tiny_model), "f16", cache) == out
    assert any(str(out) in r.getMessage() and "SHA-256" in r.getMessage() for r in caplog.records)
    assert record.read_text().split()[0] == _sha256(out) and out.stat().st_ino != first.st_ino

    caplog.clear()
    record.unlink(missing_ok=True)
    converted = out.stat().st_ino
    with caplog.at_level(logging.WARNING, logger="specdec.model.gguf_convert"):
        assert gguf_convert.ensure_gguf(str(tiny_model), "f16", cache) == out
    assert any(str(out) in r.getMessage() and "no " in r.getMessage() for r in caplog.records)
    assert record.read_text().split()[0] == _sha256(out) and out.stat().st_ino != converted
    assert not list(out.parent.glob(".*.sha256"))  # no temporary record left behind
