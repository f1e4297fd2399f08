"""Lean model runners: specdec's own forward pass for the architectures it serves most.

A transformers forward is ~20 Python modules deep per layer (norms, rotary embedding, attention
interface, cache update, residuals), each dispatching several small ops; on a 2-core CPU that
framework work cost more than the weights themselves (docs/performance.md, "The target step at
the floor"). A runner does the same arithmetic with the fewest ops it can: one packed oneDNN
linear per projection (weights packed once by :class:`specdec.model.linears.FastLinears`), the residual
add fused into the output projections, the activation fused into the MLP's input projection,
rotary and attention on all heads at once, and each segment's keys and values written in place
into its :class:`specdec.model.ragged.SessionKV`.

A runner only executes a planned batch (:class:`RunnerBatch`): the sessions, their cached lengths
and the rows to compute were decided by the caller. Every op is row-independent (a row's linear
sums, norms and activations never see another row; attention sees only its own session), so a
verify of k + 1 rows computes exactly what k + 1 plain steps compute, and one session's result
does not depend on the sessions batched beside it.

Supported: ``llama`` (Llama, SmolLM, TinyLlama … without sliding windows) and ``gpt2``. Any other
model, or a configuration a runner does not cover, runs through transformers (``runner_for``
returns None and says why in the log).
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from specdec.model.ragged import Segment
from specdec.native import Kernels, Layer, kernels

logger = logging.getLogger(__name__)

# Packed passes of fewer rows are padded to this many: oneDNN's packed kernel runs a whole plain
# step of 1 or 2 rows slower than the same step padded to 4 (docs/benchmarks.md, "The runner on
# specdec.native: cost by rows"); a row's sums do not change.
PACK_PAD_ROWS = 4
# Passes of more rows than this are padded up to one of 8 sizes per doubling (at most 12.5 % more
# rows; the prefills of long prompts and large batched passes). oneDNN and torch's ideep layer each
# keep an LRU cache of up to 1,024 kernels, one per input shape and weight shape, so a server that
# saw every row count would fill both with kernels it seldom reuses (docs/performance.md, "Memory
# under mixed traffic"); with the sizes bucketed, at most ~110 row counts below 4,096 rows ever
# occur.
PACK_EXACT_ROWS = 64


def embed(ids: torch.Tensor, table: Any) -> torch.Tensor:
    """The rows of ``table`` (an fp32 [vocab, hidden] tensor, or specdec.model.gguf_model.QuantRows:
    quantised embeddings, dequantised row by row) at ``ids``."""
    if isinstance(table, torch.Tensor):
        return F.embedding(ids, table)
    return table.lookup(ids)


def padded_rows(rows: int) -> int:
    """The rows a packed pass of ``rows`` rows computes: at least :data:`PACK_PAD_ROWS`, exact up to
    :data:`PACK_EXACT_ROWS`, then the next multiple of 1/8 of the power of two below (65 -> 72,
    129 -> 144). A row's sums never depend on the rows beside it, so padding changes no result."""
    if rows <= PACK_EXACT_ROWS:
        return max(rows, PACK_PAD_ROWS)
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [rows, features] with zero rows appended up to :func:`padded_rows` (none are added to
    an empty ``x``)."""
    rows = x.shape[0]
    pad = padded_rows(rows) - rows if rows else 0
    return torch.cat((x, x.new_zeros(pad, x.shape[1]))) if pad else x


@dataclass
class RunnerBatch:
    """One planned forward: every segment's new tokens packed into one sequence of rows."""

    ids: torch.Tensor  # [T] long, the new tokens of all segments, segment after segment
    positions: torch.Tensor  # [T] long, each row's absolute position in its session
    segments: list[Segment]  # one per session: its KV, cached length, rows and first row
    keep: torch.Tensor  # [R] long, the rows whose logits are wanted


class OutputBuffer:
    """A pass's logits written into memory the process already has, where the last pass's logits
    are no longer referenced.

    glibc maps each block of at least ``specdec.process.MMAP_THRESHOLD`` bytes on its own and
    unmaps it when freed (see there), so a fresh [rows, vocab] fp32 tensor per pass (3.3 MB for a
    17-row verify of the embedded target) would be mapped, faulted in page by page from inside the
    lm_head's parallel loop, and unmapped again, which makes that lm_head several times dearer
    (docs/benchmarks.md, "Logits memory and sampling transforms"). The buffer is reused only while
    nothing else holds it (the storage's use count: a caller may keep a pass's logits, or views of
    them, as long as it likes; the next pass then takes a new buffer). Outputs below ``floor``
    bytes, which the heap serves anyway, and above ``cap`` bytes are allocated fresh.
    """

    def __init__(self, floor: int = 256 << 10, cap: int = 64 << 20) -> None:
        self.floor, self.cap = floor, cap
        self._flat: torch.Tensor | None = None

    def take(self, rows: int, cols: int) -> torch.Tensor:
        """A contiguous fp32 [rows, cols] tensor, uninitialised."""
        n = rows * cols
        if not (self.floor <= 4 * n <= self.cap) or _storage_uses is None:
            return torch.empty(rows, cols, dtype=torch.float32)
        flat = self._flat
        # the buffer's own tensor and the storage object made to ask: 2 uses when no one else holds it
        if flat is None or flat.numel() < n or _storage_uses(flat.untyped_storage()._cdata) > 2:
            flat = self._flat = torch.empty(n, dtype=torch.float32)
        return flat[:n].view(rows, cols)


_storage_uses = getattr(torch._C, "_storage_Use_Count", None)  # None: every output allocated fresh


class _Linear:
    """One projection on its packed weight: ``x @ W.T + b`` with an optional fused activation
    (``act``) or residual (``add``), on specdec.native's kernel or oneDNN's (``native`` None)."""

    __slots__ = ("weight", "bias", "op", "binary", "out_features", "native")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, op: Any, out_features: int,
                 native: Kernels | None = None) -> None:
        self.weight, self.bias, self.op, self.out_features, self.native = weight, bias, op, out_features, native
        self.binary = torch.ops.mkldnn._linear_pointwise.binary if native is None else None

    def __call__(self, x: torch.Tensor, act: str = "none", algorithm: str = "",
                 out: OutputBuffer | None = None) -> torch.Tensor:
        """``act(x @ W.T + b)``; on specdec.native written into ``out``'s buffer when given."""
        if self.native is not None:
            return self.native.linear(x, self.weight, self.out_features, self.bias,
                                      "gelu_tanh" if act == "gelu" else act,
                                      out=None if out is None else out.take(x.shape[0], self.out_features))
        return self.op(x, self.weight, self.bias, act, [], algorithm)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + x @ W.T + b`` in one call (a post-op sum: the same fp32 add)."""
        if self.native is not None:
            return self.native.linear(x, self.weight, self.out_features, self.bias, residual=residual)
        return self.binary(x, residual, self.weight, self.bias, "add")


def _linear(fast: Any, *modules: Any) -> _Linear:
    """The packed linear of ``modules``: one layer, or all the layers of one fused group, in
    order (raises KeyError when they are not packed exactly so)."""
    parts = [fast.packed(m) for m in modules]
    first = parts[0]
    if not (all(p.weight is first.weight for p in parts) and first.start == 0 and parts[-1].end == first.group_out
            and all(a.end == b.start for a, b in zip(parts, parts[1:], strict=False))):
        raise KeyError(f"{type(modules[0]).__name__} layers not packed as one weight")
    return _Linear(first.weight, first.bias, fast.onednn, first.group_out, fast.native)


def fused_groups(model: Any) -> list[list[Any]]:
    """Linear layers of ``model`` that read the same input and that its runner runs as one
    packed weight (see ``specdec.model.linears.FastLinears``): per Llama layer q/k/v and gate/up."""
    if getattr(model.config, "model_type", None) != "llama" or not hasattr(model, "model"):
        return []
    groups = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        groups += [[attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]]
    return groups


class _Runner:
    """What the two runners share: padding, attention over each session's KV, the lm_head."""

    name = ""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, scale: float, lm_head: _Linear) -> None:
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.group = heads // kv_heads
        self.scale = scale
        self.lm_head = lm_head
        self.logits_out = OutputBuffer()
        # specdec.native's kernels for the work between the linears (None: torch ops, the same
        # results up to rounding); the linears run on it too where the weights were packed for it
        self.native: Kernels | None = kernels()
        # oneDNN's packed kernel runs few rows faster padded (PACK_PAD_ROWS); specdec.native's does not
        self.pad = pad_rows if lm_head.native is None else (lambda x: x)

    def forward(self, batch: RunnerBatch) -> torch.Tensor:
        """Logits [R, V] fp32 of the ``keep`` rows of ``batch``; writes every segment's keys and
        values into its KV buffer (positions ``start .. start + rows``)."""
        raise NotImplementedError

    def _build_stack(self) -> None:
        """The decoder layers as kernels.c's sd_forward_decoder reads them (``stack``: pointers into
        the packed weights and norms, which live as long as the runner), where every linear is on
        specdec.native; None otherwise. Each runner calls it at the end of its construction.
        ``fused`` False keeps one call per kernel (the same kernels, the same bits; for tests)."""
        self.stack: ctypes.Array | None = None
        self.quant_k, self.fused = 0, True
        parts = [self._stack_layer(i) for i in range(len(self.layers))]
        if self.native is None or any(lin.native is None for lin in self._linears()):
            return
        stack = (Layer * len(parts))()
        for i, (*ws, ln2_w, ln2_b, after_w, after_b) in enumerate(parts):
            stack[i] = Layer(*(Kernels.lin(w.weight, w.out_features, w.bias) for w in ws),
                             *(None if t is None else t.data_ptr() for t in (ln2_w, ln2_b, after_w, after_b)))
        self.stack = stack
        self.quant_k = max((lin.k for layer in stack for lin in (layer.qkv, layer.o, layer.up, layer.down)
                            if lin.fmt >= 0), default=0)

    def _stack_layer(self, i: int) -> tuple:
        """Layer ``i``'s (qkv, o, up, down linears, ln2 weight, bias, the norm after it: weight, bias)."""
        raise NotImplementedError

    def _linears(self) -> list[_Linear]:
        """Every packed linear of the runner: the lm_head and each layer's four."""
        return [self.lm_head, *(w for i in range(len(self.layers)) for w in self._stack_layer(i)[:4])]

    def _stacked(self, x: torch.Tensor, ln1: tuple[torch.Tensor, torch.Tensor | None], kv_heads: int, gated: bool,
                 up_act: str, cos: torch.Tensor | None, sin: torch.Tensor | None,
                 table: torch.Tensor) -> torch.Tensor | None:
        """The final norm of every row, the stack run in one C call; None where it cannot be (not
        every linear on specdec.native, a build without sd_forward_decoder, or ``fused`` off)."""
        if self.stack is None or not self.fused or not self.native.stacked:
            return None
        return self.native.forward_decoder(x, ln1, self.stack, self.heads, kv_heads, self.head_dim, gated, up_act, cos,
                                           sin, table, self.scale, self.eps, self.quant_k)

    def _masks(self, segments: Sequence[Segment]) -> list[torch.Tensor | None]:
        """Per segment, the additive causal mask of its grouped query rows over its keys
        ([group * rows, start + rows], 0 or -inf, on the keys' device), built once per forward for
        every layer."""
        masks: list[torch.Tensor | None] = []
        for seg in segments:
            if seg.rows == 1:
                masks.append(None)
                continue
            device = seg.kv.kv.device
            allowed = torch.ones(seg.rows, seg.start + seg.rows, dtype=torch.bool, device=device).tril(diagonal=seg.start)
            mask = torch.zeros(allowed.shape, device=device).masked_fill_(~allowed, -math.inf)
            masks.append(mask.repeat(self.group, 1))
        return masks

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[Segment],
                masks: Sequence[torch.Tensor | None], out: torch.Tensor) -> None:
        """Attention of each segment's rows over its own session's keys and values.

        q: [T, heads, D]; k, v: [T, kv_heads, D] of the packed rows (rotated). Writes [rows, heads * D]
        of each segment into ``out``. Query heads are grouped under their key/value head (head h
        reads kv head h // group, as transformers' ``repeat_kv``), so grouped-query attention runs
        as one batched matmul per segment with no copy of the keys and values.
        """
        kvh, group, d = self.kv_heads, self.group, self.head_dim
        for seg, mask in zip(segments, masks, strict=True):
            lo, hi, end = seg.offset, seg.offset + seg.rows, seg.start + seg.rows
            buf = seg.kv.kv[layer]  # [2, kv_heads, capacity, D]
            buf[:, :, seg.start:end] = torch.stack((k[lo:hi], v[lo:hi])).transpose(1, 2)
            keys, values = buf[0, :, :end], buf[1, :, :end]  # [kv_heads, L, D], views
            # [rows, heads, D] -> [kv_heads, group * rows, D]: row-major over (group, row)
            qg = q[lo:hi].transpose(0, 1).reshape(kvh, group * seg.rows, d)
            scores = torch.baddbmm(mask, qg, keys.transpose(1, 2), alpha=self.scale) if mask is not None \
                else torch.bmm(qg, keys.transpose(1, 2)).mul_(self.scale)
            o = torch.bmm(torch.softmax(scores, dim=-1), values)  # [kv_heads, group * rows, D]
            out[lo:hi] = o.view(kvh * group, seg.rows, d).transpose(0, 1).reshape(seg.rows, kvh * group * d)

    def _logits(self, x: torch.Tensor, keep: torch.Tensor, norm: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        rows = keep.shape[0]
        if not rows:  # a prefill chunk: its keys and values are all it is for
            return x.new_empty(0, self.lm_head.out_features)
        h = norm(self.pad(x.index_select(0, keep)))
        return self.lm_head(h, out=self.logits_out)[:rows]


class LlamaRunner(_Runner):
    """Llama-architecture decoder (RMSNorm, rotary, grouped-query attention, SwiGLU MLP)."""

    name = "llama"

    @classmethod
    def unsupported(cls, model: Any) -> str | None:
        config = model.config
        if getattr(config, "hidden_act", "silu") != "silu":
            return f"hidden_act {config.hidden_act!r} (the runner fuses silu)"
        if getattr(config, "pretraining_tp", 1) not in (None, 1):
            return "pretraining_tp > 1"
        return None

    def __init__(self, model: Any, fast: Any) -> None:
        config = model.config
        inner = model.model
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        super().__init__(heads, config.num_key_value_heads, head_dim, head_dim ** -0.5, _linear(fast, model.lm_head))
        self.hidden = config.hidden_size
        self.embed = getattr(model, "specdec_embedding", None) or inner.embed_tokens.weight
        self.rotary = inner.rotary_emb
        self.eps = config.rms_norm_eps
        self.final_norm = inner.norm.weight
        self.intermediate = config.intermediate_size
        self.layers = [
            (layer.input_layernorm.weight,
             _linear(fast, layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
             _linear(fast, layer.self_attn.o_proj), layer.post_attention_layernorm.weight,
             _linear(fast, layer.mlp.gate_proj, layer.mlp.up_proj), _linear(fast, layer.mlp.down_proj))
            for layer in inner.layers
        ]
        # the norm after each layer (the next layer's input norm, the final one after the last):
        # the native forward fuses each layer's residual add into it
        self.norms_after = [layer[0] for layer in self.layers[1:]] + [self.final_norm]
        self._build_stack()

    def _stack_layer(self, i: int) -> tuple:
        _, wqkv, wo, ln2, wgate_up, wdown = self.layers[i]
        return wqkv, wo, wgate_up, wdown, ln2, None, self.norms_after[i], None

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm: x * rsqrt(mean(x^2) + eps), then the weight
        return F.rms_norm(x, (self.hidden,), weight, self.eps)

    def forward(self, batch: RunnerBatch) -> torch.Tensor:
        t = batch.ids.shape[0]
        x = self.pad(embed(batch.ids, self.embed))
        tp = x.shape[0]
        positions = batch.positions if tp == t else torch.cat((batch.positions, batch.positions.new_zeros(tp - t)))
        cos, sin = self.rotary(x, positions[None])  # [1, Tp, D]: cos and sin repeated over both halves
        if self.native is not None:
            return self._forward_native(x, cos[0], sin[0], batch)
        heads, kvh, d = self.heads, self.kv_heads, self.head_dim
        half = d // 2
        # transformers' rotary: q * cos + rotate_half(q) * sin, rotate_half(q) = (-q2, q1), so with
        # the sign folded into sin it is the two halves swapped (a flip), times (-sin1, sin2)
        cos, sin = cos[0, :, None], torch.cat((-sin[0, :, None, :half], sin[0, :, None, half:]), dim=-1)
        masks = self._masks(batch.segments)
        attn = x.new_zeros(tp, heads * d)
        n_qk = (heads + kvh) * d
        for i, (ln1, wqkv, wo, ln2, wgate_up, wdown) in enumerate(self.layers):
            qkv = wqkv(self._norm(x, ln1))  # [Tp, (heads + 2 kv_heads) * D]
            qk = qkv[:, :n_qk].view(tp, heads + kvh, d)
            qk = torch.addcmul(qk * cos, qk.view(tp, heads + kvh, 2, half).flip(2).view(tp, heads + kvh, d), sin)
            v = qkv[:, n_qk:].view(tp, kvh, d)
            self._attend(i, qk[:, :heads], qk[:, heads:], v, batch.segments, masks, attn)
            x = wo.add(attn, x)
            gate_up = wgate_up(self._norm(x, ln2))  # [Tp, 2 * intermediate]
            x = wdown.add(F.silu(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:], x)
        return self._logits(x, batch.keep, lambda y: self._norm(y, self.final_norm))

    def _forward_native(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: RunnerBatch) -> torch.Tensor:
        """:meth:`forward` with the work between the linears in specdec.native, three calls a layer:
        each residual add fused with the norm after it, rotary + KV write + attention, the gate. With
        every linear on specdec.native too, the whole stack is one call (sd_forward_decoder: the same
        kernels in the same order, ~200 fewer Python-to-C calls a step of a 30-layer model)."""
        native, eps = self.native, self.eps
        heads, kvh, d = self.heads, self.kv_heads, self.head_dim
        table = native.segment_table(batch.segments)
        h = self._stacked(x, (self.layers[0][0], None), kvh, True, "none", cos, sin, table)
        if h is not None:
            return self._logits(h, batch.keep, lambda y: y)
        offsets = (0, heads * d, (heads + kvh) * d)
        attn = x.new_zeros(x.shape[0], heads * d)  # rows outside every segment (padding) stay 0
        h = native.add_norm(x, None, self.layers[0][0], None, eps)
        for i, (_, wqkv, wo, ln2, wgate_up, wdown) in enumerate(self.layers):
            native.attention(wqkv(h), offsets, heads, kvh, d, cos, sin, table, i, self.scale, attn)
            h = native.add_norm(x, wo(attn), ln2, None, eps)  # x += attention's projection
            h = native.add_norm(x, wdown(native.silu_mul(wgate_up(h))), self.norms_after[i], None, eps)  # x += the MLP's
        return self._logits(h, batch.keep, lambda y: y)


class GPT2Runner(_Runner):
    """GPT-2 decoder (LayerNorm, learned positions, multi-head attention, tanh-GELU MLP)."""

    name = "gpt2"

    @classmethod
    def unsupported(cls, model: Any) -> str | None:
        config = model.config
        if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            return f"activation_function {config.activation_function!r} (the runner fuses tanh-GELU)"
        if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx or config.reorder_and_upcast_attn:
            return "non-default attention scaling options"
        return None

    def __init__(self, model: Any, fast: Any) -> None:
        config = model.config
        inner = model.transformer
        heads = config.n_head
        head_dim = config.n_embd // heads
        super().__init__(heads, heads, head_dim, head_dim ** -0.5, _linear(fast, model.lm_head))
        self.hidden = config.n_embd
        self.eps = config.layer_norm_epsilon
        self.wte, self.wpe = getattr(model, "specdec_embedding", None) or inner.wte.weight, inner.wpe.weight
        self.final_norm = (inner.ln_f.weight, inner.ln_f.bias)
        self.layers = [
            (block.ln_1.weight, block.ln_1.bias, _linear(fast, block.attn.c_attn), _linear(fast, block.attn.c_proj),
             block.ln_2.weight, block.ln_2.bias, _linear(fast, block.mlp.c_fc), _linear(fast, block.mlp.c_proj))
            for block in inner.h
        ]
        # (weight, bias) of the norm after each layer, as in LlamaRunner.norms_after
        self.norms_after = [(layer[0], layer[1]) for layer in self.layers[1:]] + [self.final_norm]
        self._build_stack()

    def _stack_layer(self, i: int) -> tuple:
        _, _, c_attn, c_proj, w2, b2, c_fc, mlp_proj = self.layers[i]
        return c_attn, c_proj, c_fc, mlp_proj, w2, b2, *self.norms_after[i]

    def forward(self, batch: RunnerBatch) -> torch.Tensor:
        heads, d, n = self.heads, self.head_dim, self.hidden
        x = self.pad(embed(batch.ids, self.wte) + F.embedding(batch.positions, self.wpe))
        if self.native is not None:
            return self._forward_native(x, batch)
        tp = x.shape[0]
        masks = self._masks(batch.segments)
        attn = x.new_zeros(tp, n)
        for i, (w1, b1, c_attn, c_proj, w2, b2, c_fc, mlp_proj) in enumerate(self.layers):
            qkv = c_attn(F.layer_norm(x, (n,), w1, b1, self.eps)).view(tp, 3, heads, d)
            self._attend(i, qkv[:, 0], qkv[:, 1], qkv[:, 2], batch.segments, masks, attn)
            x = c_proj.add(attn, x)
            x = mlp_proj.add(c_fc(F.layer_norm(x, (n,), w2, b2, self.eps), "gelu", "tanh"), x)
        w, b = self.final_norm
        return self._logits(x, batch.keep, lambda y: F.layer_norm(y, (n,), w, b, self.eps))

    def _forward_native(self, x: torch.Tensor, batch: RunnerBatch) -> torch.Tensor:
        """:meth:`forward` with norms (each fused with the residual add before it) and attention in
        specdec.native."""
        native, eps, heads, d, n = self.native, self.eps, self.heads, self.head_dim, self.hidden
        table = native.segment_table(batch.segments)
        h = self._stacked(x, self.layers[0][:2], heads, False, "gelu_tanh", None, None, table)
        if h is not None:
            return self._logits(h, batch.keep, lambda y: y)
        attn = x.new_zeros(x.shape[0], n)  # rows outside every segment (padding) stay 0
        h = native.add_norm(x, None, self.layers[0][0], self.layers[0][1], eps)
        for i, (_, _, c_attn, c_proj, w2, b2, c_fc, mlp_proj) in enumerate(self.layers):
            native.attention(c_attn(h), (0, n, 2 * n), heads, heads, d, None, None, table, i, self.scale, attn)
            h = native.add_norm(x, c_proj(attn), w2, b2, eps)
            h = native.add_norm(x, mlp_proj(c_fc(h, "gelu", "tanh")), *self.norms_after[i], eps)
        return self._logits(h, batch.keep, lambda y: y)


RUNNERS: dict[str, type[_Runner]] = {"llama": LlamaRunner, "gpt2": GPT2Runner}


def runner_for(model: Any, fast: Any, native: bool = True) -> _Runner | None:
    """The lean runner of ``model`` (None when its architecture or configuration is not covered,
    when its weights are not packed fp32 CPU linears, or when this torch build lacks the fused
    oneDNN ops; the caller then runs the transformers forward). ``native`` False keeps the work
    between the linears on torch ops even where the linears run on specdec.native."""
    config = model.config
    cls = RUNNERS.get(getattr(config, "model_type", ""))
    why = "no runner for this architecture" if cls is None else cls.unsupported(model)
    if why is None and fast.kernel not in ("native", "packed"):
        why = f"linear weights on the {fast.kernel!r} kernel, not packed"
    if why is None:
        try:
            runner = cls(model, fast)
        except (KeyError, AttributeError, RuntimeError) as exc:  # a layer that was not packed, an odd layout
            why = f"{type(exc).__name__}: {exc}"
        else:
            if not native:
                runner.native = None
            logger.info("forward passes run on specdec's %s runner (%s between the linears)", runner.name,
                        "torch ops" if runner.native is None else "specdec.native")
            return runner
    logger.info("forward passes run through transformers (%s)", why)
    return None
