"""specdec's native kernels (kernels.c and its parts): a decoder layer's work between its linears, in C.

specdec.model.runner calls three of them a layer (residual add + norm, rotary + KV write + attention,
the SwiGLU gate) instead of ~20 small torch ops, and for a Llama or GPT-2 model whose linears are
all on these kernels runs the whole decoder stack in one call (:meth:`Kernels.forward_decoder`); see kernels.c
for what they compute and why a row's result never depends on the rows beside it.

The library is compiled on first use with the system's C compiler (``$CC``, else ``cc``) into
``<cache>/native/`` (``SPECDEC_NATIVE_DIR`` overrides the folder), one file per source, flags and
architecture, so a changed kernel builds anew and a stale build is never loaded. A build is
reused only when its SHA-256 equals the one recorded beside it at build time (``<file>.sha256``)
and it and that record are owned by this user or root and writable by no one else; else it is
built again (:func:`build`). One build serves every x86-64 CPU (its vector code is cloned per
instruction set and chosen at load time). Without a compiler, or when the build fails,
:func:`kernels` returns None with the reason logged, and the runner keeps its torch ops (the same
results up to rounding, slower: docs/performance.md). ``python -m specdec.native`` builds it ahead of
time (the container image does) and prints where it is.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch  # noqa: F401  # loaded first: the library's OpenMP calls then run on torch's own libgomp pool

from specdec.integrity import file_sha256, mismatch, process_umask, record_sha256, sidecar

logger = logging.getLogger(__name__)

FOLDER = Path(__file__).parent
SOURCE = FOLDER / "kernels.c"
FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=fast", "-std=gnu11", "-Wall", "-Werror", "-Wno-psabi")
SANITIZE_FLAGS = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all")
DISABLE_ENV = "SPECDEC_NATIVE"  # "0": never build or load (the runner keeps its torch ops)

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float


PANEL = 16  # output columns per panel of a packed linear weight (kernels.c)
ACTIVATIONS = {"none": 0, "gelu_tanh": 1}
# GGUF block types the quantised linears compute in their own format (quant.h), by kernel id
QUANT_FORMATS = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}
QUANT_BLOCK = 32  # x is quantised per block of 32 (the kernels' QBLOCK); K-quants' super-blocks are 256


@dataclass(frozen=True)
class QuantWeight:
    """A GGUF-quantised [out, in] weight packed by :meth:`Kernels.pack_quant` (uint8 bytes)."""

    data: torch.Tensor
    fmt: str  # a key of QUANT_FORMATS, or "mixed": parts of several formats (:meth:`Kernels.pack_quant_parts`)
    out_features: int
    in_features: int
    parts: torch.Tensor | None = None  # mixed: int64 [parts, 3] of (format code, out_features, byte offset)


class Lin(ctypes.Structure):
    """kernels.c's sd_lin: one linear of :meth:`Kernels.forward_decoder`."""

    _fields_ = [("w", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("fmt", ctypes.c_int64), ("parts", ctypes.c_void_p), ("nparts", ctypes.c_int64)]


class Layer(ctypes.Structure):
    """kernels.c's sd_layer: one decoder layer of :meth:`Kernels.forward_decoder` (``up``: gate/up
    or c_fc; norm biases None for RMSNorm)."""

    _fields_ = [("qkv", Lin), ("o", Lin), ("up", Lin), ("down", Lin), ("ln2_w", ctypes.c_void_p),
                ("ln2_b", ctypes.c_void_p), ("after_w", ctypes.c_void_p), ("after_b", ctypes.c_void_p)]


def _check_input(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    """ValueError unless ``t`` is a contiguous fp32 CPU tensor of ``shape`` (what the C side reads)."""
    if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device.type != "cpu"
            or not t.is_contiguous() or tuple(t.shape) != shape):
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a contiguous fp32 CPU tensor of shape {list(shape)}, got {got}")


class NativeError(RuntimeError):
    """The native library could not be built or loaded."""


def _folder() -> Path:
    env = os.environ.get("SPECDEC_NATIVE_DIR")
    if env:
        return Path(env)
    from specdec.settings import default_cache_dir

    return Path(default_cache_dir()) / "native"


def compiler() -> str:
    """The C compiler specdec builds with (``$CC``, else ``cc``), or NativeError naming what to install."""
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise NativeError(f"no C compiler ({cc!r} not on PATH; install gcc, or set CC)")
    return path


def _companions(folder: Path, source: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.[ch]") if p.name != source.name)


def sources(source: Path | None = None) -> list[Path]:
    """The files of one build: ``source`` (kernels.c, or another version of it), then its
    companions (the other C files and headers of one library): those of its own folder when that
    holds C files of its own (another version's specdec/native, split the same way or not), else
    this package's (a lone kernels.c copied elsewhere)."""
    source = source or SOURCE
    own = _companions(source.parent, source)
    if not any(p.suffix == ".c" for p in own):
        own = _companions(FOLDER, SOURCE)
    return [source, *own]


def library_name(source: Path | None = None, flags: tuple[str, ...] = FLAGS) -> str:
    """The library's file name: a digest of the sources, the flags and the machine architecture,
    so a changed kernel builds anew and a stale build is never loaded (a prebuilt library, as in
    the container image, needs no compiler where it runs)."""
    digest = hashlib.sha256()
    for part in (*(f.read_bytes() for f in sources(source)), " ".join(flags).encode(), platform.machine().encode()):
        digest.update(part)
        digest.update(b"\0")
    return f"kernels-{platform.machine()}-{digest.hexdigest()[:16]}.so"


def untrusted(path: Path) -> str | None:
    """Why the existing build ``path`` must not be loaded, or None when it may: it and its sidecar
    must be regular files owned by this user or root (the image builds as root) and writable by
    no one else, and its SHA-256 must equal the recorded one (a truncated write, a flipped byte or
    another library under this name fails)."""
    record = sidecar(path)
    for p in (path, record):
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return f"no {p.name}"
        if not stat.S_ISREG(st.st_mode):
            return f"{p.name} is not a regular file"
        if st.st_uid not in (os.geteuid(), 0):
            return f"{p.name} is owned by uid {st.st_uid}, not this user or root"
        if st.st_mode & 0o022:
            return f"{p.name} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return mismatch(path)


def build(folder: Path | None = None, source: Path | None = None, sanitize: bool = False) -> Path:
    """The compiled library's path, compiling it first when ``folder`` has no build of these sources
    and flags yet, or one that fails :func:`untrusted` (logged, and replaced by a fresh file;
    raises :class:`NativeError` with the compiler's message). ``source``: another kernels.c (a
    benchmark comparing two versions; default :data:`SOURCE`). ``sanitize``: an AddressSanitizer +
    UBSan build (``make test-native-asan``; load it with libasan preloaded)."""
    source = source or SOURCE
    folder = folder or _folder()
    flags = FLAGS + SANITIZE_FLAGS if sanitize else FLAGS
    target = folder / library_name(source, flags)
    if os.path.lexists(target):
        reason = untrusted(target)
        if reason is None:
            return target
        logger.warning("not loading %s (%s): building it again", target, reason)
    cc = compiler()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NativeError(f"cannot create {folder}: {exc}") from exc
    # compiled beside the target and renamed into place: processes starting together never load a
    # half-written file (each may compile; the last rename wins, all builds are the same)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".kernels-", suffix=".so", dir=folder)
    except OSError as exc:
        raise NativeError(f"cannot write to {folder}: {exc}") from exc
    os.close(fd)
    files = sources(source)
    cmd = [cc, *flags, f"-I{source.parent}", f"-I{FOLDER}", *(str(f) for f in files if f.suffix == ".c"),
           "-o", tmp, "-lm"]
    logger.info("compiling specdec's native kernels (a few seconds, once): %s", " ".join(cmd))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise NativeError(f"{Path(cc).name} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        # mkstemp's file is the owner's only: a library built by one user (the image's build, as
        # root) must load for the others (the services' user) as the compiler's own output would
        os.chmod(tmp, 0o755 & ~process_umask())
        # recorded from the file about to be renamed, before the rename: the name never holds a
        # library without its record (builds are byte-identical, so racing builds agree)
        record_sha256(target, file_sha256(Path(tmp)))
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeError(f"compiling {source.name} and its parts failed: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class Kernels:
    """The loaded library. Callers pass contiguous fp32 CPU tensors (the runner checks once, at
    construction, that its model qualifies; these calls check nothing, for speed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        lib = ctypes.CDLL(str(path))
        self._add_norm = lib.sd_add_norm
        self._add_norm.argtypes = [_P, _P, _P, _P, _P, _I, _I, _F]
        self._add_norm.restype = None
        self._silu_mul = lib.sd_silu_mul
        self._silu_mul.argtypes = [_P, _P, _I, _I]
        self._silu_mul.restype = None
        self._pack_linear = lib.sd_pack_linear
        self._pack_linear.argtypes = [_P, _I, _I, _P]
        self._pack_linear.restype = None
        self._linear = lib.sd_linear
        self._linear.argtypes = [_P, _I, _I, _P, _I, _P, _P, ctypes.c_int, _P]
        self._linear.restype = None
        isa = lib.sd_linear_isa
        isa.restype = ctypes.c_char_p
        self.isa: str = isa().decode()  # the linears' instruction set: avx512, avx2 or baseline
        self._pack_quant = lib.sd_pack_quant
        self._pack_quant.argtypes = [_P, _I, _I, ctypes.c_int, _P]
        self._pack_quant.restype = None
        self._quant_bytes = lib.sd_quant_bytes_as
        self._quant_bytes.argtypes = [_I, _I, ctypes.c_int, ctypes.c_int]
        self._quant_bytes.restype = _I
        self._pack_quant_as = lib.sd_pack_quant_as
        self._pack_quant_as.argtypes = [_P, _I, _I, ctypes.c_int, ctypes.c_int, _P]
        self._pack_quant_as.restype = None
        self._linear_quant_parts = lib.sd_linear_quant_parts
        self._linear_quant_parts.argtypes = [_P, _I, _I, _P, _P, _I, _I, _P, _P, ctypes.c_int, _P, _P]
        self._linear_quant_parts.restype = None
        self._linear_quant = lib.sd_linear_quant
        self._linear_quant.argtypes = [_P, _I, _I, _P, ctypes.c_int, _I, _P, _P, ctypes.c_int, _P, _P]
        self._linear_quant.restype = None
        quant_isa = lib.sd_quant_isa
        quant_isa.argtypes = [ctypes.c_int]
        quant_isa.restype = ctypes.c_char_p
        # each format's kernel here: avx2, avx512-vnni (Q4_1, Q8_0 on CPUs with it) or baseline
        # (portable, ~30x slower than avx2)
        self.quant_isas: dict[str, str] = {name: quant_isa(code).decode() for name, code in QUANT_FORMATS.items()}
        self._attention = lib.sd_attention
        self._attention.argtypes = [_P, _I, _I, _I, _I, _I, _I, _I, _P, _P, _P, _I, _I, _F, _P, _I]
        self._attention.restype = ctypes.c_int
        # absent from builds of an older kernels.c (evaluation.batchcost --native-against): the
        # runner then calls the kernels one by one
        self._forward = getattr(lib, "sd_forward_decoder", None)
        self.stacked = self._forward is not None
        if self._forward is not None:
            self._forward.argtypes = [_P, _I, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _P, _I, _F, _F,
                                      _P, _P, _P, _P, _P, _P, _P]
            self._forward.restype = ctypes.c_int

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                 eps: float) -> torch.Tensor:
        """``x += delta`` in place (when ``delta`` is given: a residual connection), then the norm
        of each row of the [rows, n] ``x``: RMSNorm ``x * rsqrt(mean(x**2) + eps) * weight`` when
        ``bias`` is None, else LayerNorm ``(x - mean) * rsqrt(var + eps) * weight + bias``."""
        out = torch.empty_like(x)
        self._add_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                       None if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a [rows, 2 * n] tensor holding gate then up."""
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, n)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, n)
        return out

    def pack_linear(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` [out, in] (fp32, contiguous) in panels of 16 output columns for
        :meth:`linear`: a flat tensor of ceil(out / 16) * in * 16 floats."""
        n, k = weight.shape
        panels = torch.empty((n + PANEL - 1) // PANEL * PANEL * k, dtype=torch.float32)
        self._pack_linear(weight.data_ptr(), n, k, panels.data_ptr())
        return panels

    def _quant_scratch(self, nbytes: int) -> torch.Tensor:
        """This thread's scratch for x's quants (kept between calls: one allocation, not 121 a step)."""
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.numel() < nbytes:
            scratch = self._local.scratch = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
        return scratch

    def quant_isa(self, fmt: str = "Q4_1") -> str:
        """The instruction set that computes GGUF format ``fmt`` here (:data:`QUANT_FORMATS`)."""
        return self.quant_isas[fmt]

    def pack_quant(self, blocks: np.ndarray, fmt: str, out_features: int, in_features: int) -> QuantWeight:
        """A GGUF tensor's raw blocks (uint8, [out, in / block * block bytes], as ``gguf.GGUFReader``
        reads a tensor of a :data:`QUANT_FORMATS` type) packed for :meth:`linear`. Raises
        ValueError for another type or a shape that does not match."""
        blocks = self._checked_blocks(blocks, fmt, out_features, in_features)
        code = QUANT_FORMATS[fmt]
        data = torch.empty(self._quant_bytes(out_features, in_features, code, 0), dtype=torch.uint8)
        self._pack_quant(blocks.ctypes.data, out_features, in_features, code, data.data_ptr())
        return QuantWeight(data, fmt, out_features, in_features)

    def pack_quant_parts(self, parts: list[tuple[np.ndarray, str, int]], in_features: int) -> QuantWeight:
        """Several GGUF tensors of one input, each (blocks, format, out_features), stacked along
        the output as one weight (a fused q/k/v or gate/up whose members the file stores in
        different types): one call computes them all, x quantised once. Every part but the last
        needs out_features a multiple of 16."""
        if not parts:
            raise ValueError("no parts")
        checked = [(self._checked_blocks(b, f, n, in_features), f, n) for b, f, n in parts]
        if any(n % PANEL for _, _, n in checked[:-1]):
            raise ValueError(f"every part but the last needs out_features a multiple of {PANEL}, got "
                             f"{[n for _, _, n in checked]}")
        sizes = [self._quant_bytes(n, in_features, QUANT_FORMATS[f], 1) for _, f, n in checked]
        data = torch.empty(sum(sizes), dtype=torch.uint8)
        table, offset = [], 0
        for (blocks, fmt, n), size in zip(checked, sizes, strict=True):
            self._pack_quant_as(blocks.ctypes.data, n, in_features, QUANT_FORMATS[fmt], 1, data.data_ptr() + offset)
            table.append((QUANT_FORMATS[fmt], n, offset))
            offset += size
        return QuantWeight(data, "mixed", sum(n for _, _, n in checked), in_features,
                           torch.tensor(table, dtype=torch.int64))

    @staticmethod
    def _checked_blocks(blocks: np.ndarray, fmt: str, out_features: int, in_features: int) -> np.ndarray:
        """``blocks`` as the packers read them, or ValueError saying what does not match."""
        if fmt not in QUANT_FORMATS:
            raise ValueError(f"quantised linears compute {', '.join(QUANT_FORMATS)}, not {fmt}")
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
        if out_features <= 0 or in_features <= 0 or in_features % block:
            raise ValueError(f"a {fmt} weight needs in_features a positive multiple of {block} and out_features > 0, "
                             f"got [{out_features}, {in_features}]")
        expected = (out_features, in_features // block * block_bytes)
        if not isinstance(blocks, np.ndarray) or blocks.dtype != np.uint8:
            raise ValueError(f"{fmt} blocks must be a uint8 numpy array, got {type(blocks).__name__} "
                             f"{getattr(blocks, 'dtype', '')}")
        blocks = np.ascontiguousarray(blocks)
        if blocks.shape != expected:
            raise ValueError(f"{fmt} blocks of shape {blocks.shape}, expected {expected}")
        return blocks

    @staticmethod
    def quant_scratch_bytes(rows: int, k: int) -> int:
        """Bytes of the scratch a quantised linear of ``rows`` rows and input ``k`` needs for x's
        quants, scales and sums (quant.c's quantise_rows)."""
        return rows * (k + 20 * (k // QUANT_BLOCK))

    def linear(self, x: torch.Tensor, panels: torch.Tensor | QuantWeight, out_features: int,
               bias: torch.Tensor | None = None, act: str = "none", residual: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``act(x @ W.T + bias) + residual`` of a [rows, in] ``x`` on ``W`` packed by
        :meth:`pack_linear` (fp32) or :meth:`pack_quant`; ``act`` "none" or "gelu_tanh". Written
        into ``out`` (contiguous fp32 [rows, out_features]) when given, else into a new tensor."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"x must be a 2-D fp32 tensor, got {getattr(x, 'shape', type(x).__name__)}")
        if act not in ACTIVATIONS:
            raise ValueError(f"act must be one of {', '.join(ACTIVATIONS)}, not {act!r}")
        rows = x.shape[0]
        if out is not None and (out.shape != (rows, out_features) or out.dtype != torch.float32
                                or not out.is_contiguous()):
            raise ValueError(f"out must be a contiguous fp32 [{rows}, {out_features}] tensor, got "
                             f"{out.dtype} {tuple(out.shape)}")
        y = x.new_empty(rows, out_features) if out is None else out
        if isinstance(panels, QuantWeight):
            k = x.shape[1]
            _check_input(x, (rows, panels.in_features), "x")
            if out_features != panels.out_features:
                raise ValueError(f"out_features {out_features} of a weight with {panels.out_features}")
            for name, t in (("bias", bias), ("residual", residual)):
                if t is not None:
                    _check_input(t, (out_features,) if name == "bias" else (rows, out_features), name)
            scratch = self._quant_scratch(self.quant_scratch_bytes(rows, k))
            if panels.parts is not None:
                self._linear_quant_parts(x.data_ptr(), rows, k, panels.data.data_ptr(), panels.parts.data_ptr(),
                                         panels.parts.shape[0], out_features, None if bias is None else bias.data_ptr(),
                                         None if residual is None else residual.data_ptr(), ACTIVATIONS[act],
                                         y.data_ptr(), scratch.data_ptr())
                return y
            self._linear_quant(x.data_ptr(), rows, k, panels.data.data_ptr(), QUANT_FORMATS[panels.fmt], out_features,
                               None if bias is None else bias.data_ptr(),
                               None if residual is None else residual.data_ptr(), ACTIVATIONS[act], y.data_ptr(),
                               scratch.data_ptr())
            return y
        self._linear(x.data_ptr(), rows, x.shape[1], panels.data_ptr(), out_features,
                     None if bias is None else bias.data_ptr(), None if residual is None else residual.data_ptr(),
                     ACTIVATIONS[act], y.data_ptr())
        return y

    @staticmethod
    def lin(weight: torch.Tensor | QuantWeight, out_features: int, bias: torch.Tensor | None) -> Lin:
        """A packed linear (:meth:`pack_linear` panels or a :class:`QuantWeight`) as
        :meth:`forward_decoder` reads it; the tensors must outlive every call that uses it."""
        if isinstance(weight, QuantWeight):
            if weight.parts is not None:
                return Lin(weight.data.data_ptr(), None if bias is None else bias.data_ptr(), out_features,
                           weight.in_features, -2, weight.parts.data_ptr(), weight.parts.shape[0])
            return Lin(weight.data.data_ptr(), None if bias is None else bias.data_ptr(), out_features,
                       weight.in_features, QUANT_FORMATS[weight.fmt])
        k = weight.numel() // ((out_features + PANEL - 1) // PANEL * PANEL)
        return Lin(weight.data_ptr(), None if bias is None else bias.data_ptr(), out_features, k, -1)

    def forward_decoder(self, x: torch.Tensor, ln1: tuple[torch.Tensor, torch.Tensor | None], layers: ctypes.Array,
                        heads: int, kv_heads: int, head_dim: int, gated: bool, up_act: str, cos: torch.Tensor | None,
                        sin: torch.Tensor | None, table: torch.Tensor, scale: float, eps: float,
                        quant_k: int = 0) -> torch.Tensor:
        """A decoder stack (``layers``: an array of :class:`Layer`) over the [T, hidden] residual
        stream ``x`` (updated in place) in one call, exactly as specdec.model.runner's calls one by one:
        per layer the qkv linear, rotary (``cos``/``sin``, or None) + KV write + attention, the
        output projection added and normed, the MLP (``gated``: SwiGLU on a gate/up weight, else
        the up projection with ``up_act`` fused) added and normed. ``ln1``: the first layer's input
        norm (weight, bias or None). Returns the final norm of every row. ``quant_k``: the widest
        input of a quantised linear (0: none)."""
        rows, hidden = x.shape
        h, delta = torch.empty_like(x), torch.empty_like(x)
        width = layers[0].up.n
        qkv = x.new_empty(rows, (heads + 2 * kv_heads) * head_dim)
        attn = x.new_zeros(rows, heads * head_dim)  # rows outside every segment (padding) stay 0
        up = x.new_empty(rows, width)
        act = x.new_empty(rows, width // 2) if gated else None
        scratch = self._quant_scratch(self.quant_scratch_bytes(rows, quant_k)) if quant_k else None
        rc = self._forward(x.data_ptr(), rows, hidden, ln1[0].data_ptr(), None if ln1[1] is None else ln1[1].data_ptr(),
                           ctypes.addressof(layers), len(layers), heads, kv_heads, head_dim, int(gated),
                           ACTIVATIONS[up_act], None if cos is None else cos.data_ptr(),
                           None if sin is None else sin.data_ptr(), table.data_ptr(), table.shape[0], scale, eps,
                           h.data_ptr(), qkv.data_ptr(), attn.data_ptr(), delta.data_ptr(), up.data_ptr(),
                           None if act is None else act.data_ptr(), None if scratch is None else scratch.data_ptr())
        if rc:
            raise MemoryError("native attention: no memory for its scores")
        return h

    @staticmethod
    def segment_table(segments: list) -> torch.Tensor:
        """The [segments, 5] int64 table :meth:`attention` reads: each segment's KV buffer address,
        its capacity, start position, rows and first packed row."""
        return torch.tensor([[s.kv.kv.data_ptr(), s.kv.kv.shape[3], s.start, s.rows, s.offset] for s in segments],
                            dtype=torch.int64)

    def attention(self, qkv: torch.Tensor, offsets: tuple[int, int, int], heads: int, kv_heads: int, head_dim: int,
                  cos: torch.Tensor | None, sin: torch.Tensor | None, table: torch.Tensor, layer: int, scale: float,
                  out: torch.Tensor) -> None:
        """Rotate (when ``cos``/``sin`` are given) the q and k heads of every segment's rows of
        ``qkv`` in place, write the rows' keys and values into their sessions' buffers (layer
        ``layer``), and write each row's attention over its session's positions up to its own
        into ``out`` [T, heads * head_dim]."""
        rc = self._attention(qkv.data_ptr(), qkv.shape[1], offsets[0], offsets[1], offsets[2], heads, kv_heads,
                             head_dim, None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
                             table.data_ptr(), table.shape[0], layer, scale, out.data_ptr(), out.shape[1])
        if rc:
            raise MemoryError("native attention: no memory for its scores")


@functools.cache
def kernels() -> Kernels | None:
    """The native kernels of this process, built on first use; None when disabled
    (``SPECDEC_NATIVE=0``) or when they cannot be built or loaded (the reason is logged once)."""
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        logger.info("native kernels disabled (%s=0)", DISABLE_ENV)
        return None
    try:
        # SPECDEC_NATIVE_SANITIZE=1: the AddressSanitizer + UBSan build (make test-native-asan)
        return Kernels(build(sanitize=os.environ.get("SPECDEC_NATIVE_SANITIZE") == "1"))
    except (NativeError, OSError) as exc:
        logger.warning("native kernels unavailable, the runner keeps torch ops (a few ms a step slower): %s", exc)
        return None


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = build()
    except NativeError as exc:
        print(f"specdec.native: {exc}", file=sys.stderr)
        return 1
    Kernels(path)
    print(path)
    return 0
