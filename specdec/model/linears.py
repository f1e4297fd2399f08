"""Faster CPU fp32 and GGUF-quantised linear layers for the few-row forwards of decoding and
verification (:class:`FastLinears`): each weight packed once, at load, for specdec.native's kernel
(or oneDNN's where that is faster), so a row's sums never depend on the other rows of its pass."""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specdec.model.runner import fused_groups, pad_rows
from specdec.native import kernels

logger = logging.getLogger(__name__)

# Without packed weights, passes above this many rows (long prefills) use the stock kernel; packed
# weights serve every pass (faster than stock at any row count: docs/benchmarks.md, "Verify cost
# by kernel").
FAST_LINEAR_MAX_ROWS = 64
# Without prepacked weights (see FastLinears): from this many rows on, oneDNN's inner product on
# the row-major weight beats MKL's ``(W @ x.T).T``; fewer rows read the weights faster through MKL.
ONEDNN_MIN_ROWS = 5
# The batch size oneDNN blocks a prepacked weight for. Any hint from 8 up gave the same speed for
# 1-64 rows and the same sums for a row whatever the rows around it; a hint of 1 did not.
PACK_ROWS_HINT = 64
KERNELS = ("native", "packed", "onednn", "mkl")


def _onednn_linear() -> Any:
    """torch's oneDNN fp32 inner product (``mkldnn::_linear_pointwise``), or None without oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None:
        return None
    try:  # the op exists in every x86 build seen; a build without its kernel fails here, not mid-forward
        op(torch.ones(2, 4), torch.ones(3, 4), None, "none", [], "")
    except RuntimeError:
        return None
    return op


def _onednn_pack() -> Any:
    """torch's oneDNN weight prepack (``mkldnn::_reorder_linear_weight``, what inductor's freezing
    uses), or None when it is missing or its packed weights do not compute ``F.linear``."""
    op = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    linear = _onednn_linear()
    if op is None or linear is None:
        return None
    try:
        w, x = torch.randn(24, 16), torch.randn(3, 16)
        y = linear(x, op(w, PACK_ROWS_HINT), None, "none", [], "")
        if not torch.allclose(y, x @ w.T, rtol=1e-4, atol=1e-5):
            return None
    except RuntimeError:
        return None
    return op


@dataclass
class Packed:
    """A linear layer's packed weight (specdec.native's panels or oneDNN's blocked layout): the
    layer's own, or one shared with the layers of its fused group, whose output columns
    ``start:end`` are this layer's."""

    weight: torch.Tensor  # panels (kernel "native") or opaque oneDNN layout, [out of the group, in_features]
    bias: torch.Tensor | None  # [out_features of the group]
    start: int
    end: int
    group_out: int  # output features of the whole packed weight

    @property
    def fused(self) -> bool:
        return self.end - self.start != self.group_out


# "on": fp32 linears on specdec.native whatever the instruction set (tests and comparisons on CPUs
# without AVX-512, where oneDNN's packed kernel is otherwise preferred)
NATIVE_LINEARS_ENV = "SPECDEC_NATIVE_LINEARS"


class FastLinears:
    """Faster CPU fp32 ``nn.Linear`` (and GPT-2's ``Conv1D``) for the few-row forwards of decoding
    and verification.

    A verify of k draft tokens is a forward of k + 1 rows; speculation pays only if it costs little
    more than a plain step of one row. Where specdec.native builds (``kernel = "native"``, the
    default), each fp32 weight is packed once, at load, into its panels of 16 output columns and
    every call runs its C kernel: it streams the weights at memory speed from one row up, sums
    every output in one fixed order whatever the other rows (so a verify computes bit for bit what
    plain steps would), and its call overhead is a fraction of oneDNN's (docs/benchmarks.md, "The
    runner on specdec.native: cost by rows"; docs/performance.md, "The target step at the floor").
    Otherwise, as follows. Stock ``F.linear`` grows steeply with the rows (MKL takes a slow path
    for 2..~10 rows of ``x @ W.T``) and oneDNN on the row-major weight re-blocks it on every call.
    So each fp32 weight is packed once, at load, into oneDNN's blocked layout (``kernel =
    "packed"``): all of the embedded target's linears then cost about the same for 1 to 9 rows,
    less than one row through the stock kernels (docs/benchmarks.md, "Verify cost by kernel"), and
    a row's sums do not depend on the other rows of the pass, so a verify computes bit for bit what
    plain steps would. The row-major weight is then freed and the packed one serves
    every call of that layer, inside :meth:`active` or not; a weight other modules share (an lm_head
    tied to the input embeddings) stays, so that one costs its size again.

    Without the prepack op, or with ``pack`` off (``kernel = "onednn"``): oneDNN on the row-major
    weight from ONEDNN_MIN_ROWS rows, MKL's ``(W @ x.T).T`` below (a single row duplicated to two),
    which streams the row-major weight faster than its one-row gemv. ``"mkl"``: that at any row
    count (``evaluation.batchcost --kernels`` times each). Only the summation blocking differs from
    the stock kernel (~1e-6 relative). These (and packed layers that kept their row-major weight)
    are active only inside :meth:`active` (per thread), so other users of the same model object
    (``generate``, tests) keep the stock kernels.
    """

    @classmethod
    def of(cls, model: Any, pack: bool = True, native: bool = True,
           quant: dict[int, tuple[str, Any]] | None = None) -> FastLinears:
        """The model's one instance (engines may share a model object; wrap its layers once; the
        first caller's options hold). ``pack``: pack the weights where this build can; ``native``:
        pack for specdec.native's kernel where it builds, else for oneDNN; ``quant``: layers
        (by ``id``) to run on GGUF-quantised weights instead, as (block type, raw blocks), see
        specdec.model.gguf_model."""
        fast = getattr(model, "_specdec_fast_linears", None)
        if not isinstance(fast, cls):
            fast = cls(model, pack, native, quant)
            model._specdec_fast_linears = fast
        return fast

    def __init__(self, model: Any, pack: bool = True, native: bool = True,
                 quant: dict[int, tuple[str, Any]] | None = None) -> None:
        self._local = threading.local()
        self.count = 0
        self._onednn = _onednn_linear()
        quant = quant or {}
        packer = self._choose_kernel(pack, native, bool(quant))
        # module id -> its packed weight: its own, or that of its fused group (Packed.start/end
        # name its output columns there)
        self._packed: dict[int, Packed] = {}
        self._released: set[int] = set()  # layers whose row-major weight was freed: packed only
        self._conv1d: set[int] = set()  # GPT-2's Conv1D layers (weight [in, out]): packed kernel only
        self.quantised = 0  # layers on GGUF-quantised weights
        linears = [(module, weight) for module in model.modules() if (weight := _linear_weight(module)) is not None]
        if packer is not None:
            with torch.inference_mode():
                for group in self._groups(model, dict((id(m), w) for m, w in linears), quant):
                    self._pack_group(group, packer, quant)
        self._wrap(model, linears)

    def _choose_kernel(self, pack: bool, native: bool, quantised: bool) -> Any:
        """Set :attr:`native` and :attr:`kernel`; the function packing a weight (None: no packing)."""
        self.native = kernels() if pack and native else None
        if (self.native is not None and self.native.isa != "avx512" and _onednn_pack() is not None
                and os.environ.get(NATIVE_LINEARS_ENV, "auto") != "on"):
            # without AVX-512 the native kernel streams a lone row as fast, but computes several
            # rows slower than oneDNN (docs/benchmarks.md, "The runner on specdec.native: cost by
            # rows"): oneDNN's packed linears then serve every pass
            logger.info("linears on oneDNN's packed kernel: specdec.native's runs %s here, not AVX-512",
                        self.native.isa)
            self.native = None
        if quantised and self.native is None:
            self.native = kernels() if native else None
            if self.native is None:
                raise RuntimeError("quantised linears need specdec.native, which is unavailable here (see the log)")
        if self.native is not None:
            self.kernel = "native"
            return lambda w, _hint: self.native.pack_linear(w)
        packer = _onednn_pack() if pack else None
        self.kernel = "packed" if packer is not None else "onednn" if self._onednn is not None else "mkl"
        return packer

    def _pack_group(self, group: list[tuple[Any, torch.Tensor]], packer: Any, quant: dict[int, tuple[str, Any]]
                    ) -> None:
        """Pack one group of layers (see :meth:`_groups`) into one weight."""
        biases = [m.bias for m, _ in group]
        bias = None if biases[0] is None else torch.cat(biases).detach() if len(group) > 1 else biases[0]
        if id(group[0][0]) in quant:  # all of a group's members are quantised, or none (_groups)
            fmts = {quant[id(m)][0] for m, _ in group}
            if len(fmts) == 1:
                raw = np.concatenate([quant[id(m)][1] for m, _ in group])
                packed = self.native.pack_quant(raw, fmts.pop(), raw.shape[0], group[0][1].shape[1])
            else:  # members stored in different types: one weight of several parts
                packed = self.native.pack_quant_parts(
                    [(quant[id(m)][1], quant[id(m)][0], w.shape[0]) for m, w in group], group[0][1].shape[1])
            self.quantised += len(group)
        else:
            weight = torch.cat([w for _, w in group]) if len(group) > 1 else group[0][1]
            packed = packer(weight.contiguous(), PACK_ROWS_HINT)
        start, group_out = 0, sum(w.shape[0] for _, w in group)
        for module, w in group:
            self._packed[id(module)] = Packed(packed, bias, start, start + w.shape[0], group_out)
            start += w.shape[0]

    def _wrap(self, model: Any, linears: list[tuple[Any, torch.Tensor]]) -> None:
        """Route every linear layer's forward here; free the row-major weight of each packed one
        no other module shares (a tied lm_head keeps it)."""
        holders: dict[int, int] = {}  # weight storage -> modules holding it (tied embeddings, shared layers)
        for module in model.modules():
            for param in module.parameters(recurse=False):
                holders[param.data_ptr()] = holders.get(param.data_ptr(), 0) + 1
        for module, _ in linears:
            if type(module) is not torch.nn.Linear:
                self._conv1d.add(id(module))
            if id(module) in self._packed and holders[module.weight.data_ptr()] == 1:
                # An empty placeholder keeps the attribute's dtype and device for whoever asks.
                module.weight = torch.nn.Parameter(module.weight.new_empty(0), requires_grad=False)
                self._released.add(id(module))
            # An instance attribute shadows the class's forward for this module only.
            module.forward = functools.partial(self._forward, module, module.forward)
            self.count += 1

    @staticmethod
    def _groups(model: Any, weights: dict[int, torch.Tensor], quant: dict[int, tuple[str, Any]]
                ) -> list[list[tuple[Any, torch.Tensor]]]:
        """The linears to pack, grouped: layers that read the same input (a Llama layer's q, k and
        v projections; its gate and up projections, see specdec.model.runner.fused_groups) share one
        packed weight when their inputs, biases, dtypes and storage (fp32, or GGUF blocks in
        ``quant``: of one type, or of several where every member but the last has a multiple of
        16 outputs) agree, every other layer packs alone. A fused group is one call whose pass
        streams each weight once for all its rows, where its members apart would be a call each
        (docs/performance.md, "The target step at the floor")."""
        groups, grouped = [], set()
        for members in fused_groups(model):
            ws = [weights.get(id(m)) for m in members]
            if any(w is None for w in ws) or len({w.shape[1] for w in ws}) != 1 \
                    or len({getattr(m, "bias", None) is None for m in members}) != 1 \
                    or len({id(m) in quant for m in members}) != 1:
                continue
            if id(members[0]) in quant and len({quant[id(m)][0] for m in members}) > 1 \
                    and any(w.shape[0] % 16 for w in ws[:-1]):
                continue
            groups.append(list(zip(members, ws, strict=True)))
            grouped.update(id(m) for m in members)
        module_of = {id(m): m for m in model.modules()}
        groups += [[(module_of[key], w)] for key, w in weights.items() if key not in grouped]
        return groups

    def _packed_forward(self, module: Any, x2: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        rows = x2.shape[0]
        p = self._packed[id(module)]
        if self.native is not None:
            y = self.native.linear(x2.contiguous(), p.weight, p.group_out, p.bias)
        else:
            y = self._onednn(pad_rows(x2).contiguous(), p.weight, p.bias, "none", [], "")
        if p.fused:  # this layer's columns of its group's output (transformers' own forward only)
            y = y[:, p.start:p.end]
        return y[:rows].reshape(*shape[:-1], y.shape[-1])

    def packed(self, module: Any) -> Packed:
        """The packed weight serving one of the model's linear layers (KeyError when none)."""
        return self._packed[id(module)]

    @property
    def onednn(self) -> Any:
        """torch's oneDNN linear op the packed weights run on (None without oneDNN)."""
        return self._onednn

    @property
    def released(self) -> int:
        """Layers served by their packed weight alone (the row-major one freed)."""
        return len(self._released)

    @property
    def kernels(self) -> tuple[str, ...]:
        """The kernels this model can run now, fastest first (packed only once weights are freed)."""
        if self._released:
            return (self.kernel,)
        if self._onednn is None:
            return ("native", "mkl") if self.kernel == "native" else ("mkl",)
        if self.kernel == "native":  # its weights are packed for specdec.native, not oneDNN
            return ("native", "onednn", "mkl")
        return KERNELS[KERNELS.index(self.kernel):]

    def active(self) -> _ActiveScope:
        return _ActiveScope(self._local)

    def _forward(self, module: torch.nn.Linear, stock: Any, x: torch.Tensor) -> torch.Tensor:
        if id(module) in self._released:  # no row-major weight left: the packed one, always
            return self._packed_forward(module, x.reshape(-1, x.shape[-1]).to(torch.float32), x.shape).to(x.dtype)
        if not getattr(self._local, "on", False) or x.dim() < 2:
            return stock(x)
        x2 = x.reshape(-1, x.shape[-1])
        rows = x2.shape[0]
        if rows == 0 or x2.dtype != torch.float32:
            return stock(x)
        if self.kernel in ("native", "packed"):
            return self._packed_forward(module, x2, x.shape)
        if rows > FAST_LINEAR_MAX_ROWS or id(module) in self._conv1d:
            return stock(x)
        if self.kernel == "onednn" and rows >= ONEDNN_MIN_ROWS:
            y = self._onednn(x2.contiguous(), module.weight, module.bias, "none", [], "")
            return y.reshape(*x.shape[:-1], y.shape[-1])
        if rows == 1:
            y = (module.weight @ torch.cat((x2, x2)).T)[:, :1].T.contiguous()
        else:
            y = (module.weight @ x2.T).T.contiguous()
        if module.bias is not None:
            y += module.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def _linear_weight(module: Any) -> torch.Tensor | None:
    """The weight of a fp32 CPU linear layer as [out, in] (``nn.Linear``'s layout; transformers'
    ``Conv1D``, GPT-2's, stores [in, out]), or None for any other module."""
    if type(module) is torch.nn.Linear:
        weight = module.weight.detach()
    elif type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None \
            and module.weight.dim() == 2:
        weight = module.weight.detach().T
    else:
        return None
    return weight if weight.device.type == "cpu" and weight.dtype == torch.float32 else None


class _ActiveScope:
    def __init__(self, local: threading.local) -> None:
        self._local = local

    def __enter__(self) -> None:
        self._prev = getattr(self._local, "on", False)
        self._local.on = True

    def __exit__(self, *exc: Any) -> None:
        self._local.on = self._prev

