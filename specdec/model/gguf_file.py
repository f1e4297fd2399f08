"""A GGUF file's metadata and tensors, read in one pass.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array, so opening the
embedded draft (a 49,152-token vocabulary and its merges) takes ~3.6 s on the 2-core machines this
project is measured on, and transformers' own GGUF loading opens it twice more. The draft services
open their file at every start; this reader parses the same format (GGUF v2/v3, the layout
llama.cpp's ``gguf.h`` documents) with ``struct`` over a memory map in ~0.1 s. The data types and
block sizes come from the ``gguf`` package itself (:data:`gguf.constants.GGML_QUANT_SIZES`), and a
tensor's data is a read-only view of the mapped file, never a copy.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types (gguf.h): their struct codes; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True)
class Tensor:
    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the innermost (contiguous) dimension first
    data: np.ndarray  # uint8 [rows, bytes a row] for block types, else [rows, columns] of the dtype

    @property
    def type_name(self) -> str:
        return self.type.name


class GGUFFile:
    """``fields``: metadata by key (ints, floats, bools, strings, lists); ``tensors``: by name."""

    def release_pages(self) -> None:
        """Drop the file's pages from this process's resident memory (MADV_DONTNEED on the read-only
        mapping: the tensors stay readable, faulted in again from the page cache when read). For
        an engine that has packed the weights into memory of its own."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (no GGUF magic)")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {version} (this reader knows 2 and 3)")
        self.version = version
        self._at = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._u32())
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = struct.unpack_from(f"<{self._u32()}Q", buf, self._at)
            self._at += 8 * len(dims)
            kind, offset = struct.unpack_from("<IQ", buf, self._at)
            self._at += 12
            infos.append((name, dims, kind, offset))
        align = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._at // align) * align
        data = np.frombuffer(buf, dtype=np.uint8)
        self.tensors: dict[str, Tensor] = {}
        for name, dims, kind, offset in infos:
            try:
                qtype = GGMLQuantizationType(kind)
            except ValueError as exc:
                raise GGUFError(f"{self.path}: tensor {name} has unknown type {kind}") from exc
            block, size = GGML_QUANT_SIZES[qtype]
            row = dims[0] // block * size  # bytes of one row
            rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
            raw = data[start + offset : start + offset + rows * row].reshape(rows, row)
            if qtype in _PLAIN:
                raw = raw.view(_PLAIN[qtype])
            self.tensors[name] = Tensor(name, qtype, tuple(int(d) for d in dims), raw)

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def _u32(self) -> int:
        (value,) = struct.unpack_from("<I", self._map, self._at)
        self._at += 4
        return value

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._at)
        self._at += 8
        value = self._map[self._at : self._at + n].decode("utf-8", errors="replace")
        self._at += n
        return value

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            inner, n = struct.unpack_from("<IQ", self._map, self._at)
            self._at += 12
            if inner in _SCALARS:  # one numpy read for the whole array
                dtype = np.dtype("<" + _SCALARS[inner])
                values = np.frombuffer(self._map, dtype=dtype, count=n, offset=self._at)
                self._at += n * dtype.itemsize
                return values.tolist()
            return [self._value(inner) for _ in range(n)]
        code = _SCALARS.get(kind)
        if code is None:
            raise GGUFError(f"{self.path}: metadata value type {kind} is unknown")
        (value,) = struct.unpack_from("<" + code, self._map, self._at)
        self._at += struct.calcsize(code)
        return value


_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
