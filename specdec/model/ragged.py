"""Ragged batched forward passes over per-session KV buffers, for transformers causal LMs.

Continuous batching needs one forward pass over the new tokens of many sessions at once, each
session at its own positions and attending only to its own cache. This module does that without
ever copying a session's keys and values into a padded batch:

- :class:`SessionKV` holds one session's keys and values for every layer in one preallocated
  buffer ``[layers, 2, kv_heads, capacity, head_dim]``. New tokens are written in place; a crop only
  moves ``length``; the buffer grows (one copy) in steps, rarely.
- The batch is *packed*: all sessions' new tokens form one sequence of rows ``[1, T, hidden]``, with
  per-row ``position_ids``. Every linear layer (the bulk of the cost) runs once over all T rows.
- :class:`RaggedBatch` stands in for the transformers cache: each attention layer's
  ``past_key_values.update`` writes the new keys/values of every segment into its session's buffer.
- :func:`ragged_attention`, registered as the attention implementation ``specdec_ragged``, then
  runs attention per segment over a *view* of that session's buffer (no copy), causal within the
  segment's new rows; or, on the ``varlen`` path (:func:`attention_path`: CUDA), in one call over
  the packed rows of every segment.

Every tensor a batch creates (masks, indices) is created on its KV buffers' device: a mask built
on the CPU beside CUDA keys fails the first multi-row pass (tests/unit/test_device.py runs the whole
forward on PyTorch's ``meta`` device to catch that on machines without a GPU).

Linear layers sum a row's dot products the same way whatever the other rows are only up to the
kernel's blocking: batched and single-session results may differ in the last bits (see
docs/batching.md for what that means for greedy equality).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ATTENTION = "specdec_ragged"

# Buffers grow in multiples of this many tokens (and at least double, up to GROW_MAX at a time), so
# a session of n tokens costs O(log n) copies over its life and wastes little memory.
GROW_MIN = 64
GROW_MAX = 1024

SEGMENTS = "segments"
VARLEN = "varlen"
ATTENTION_PATHS = (SEGMENTS, VARLEN)


def attention_path(device: torch.device) -> str:
    """How a packed batch attends on ``device``: ``varlen`` on CUDA, ``segments`` elsewhere.

    ``segments``: one attention call per session over a view of its own buffer: no copy and no
    masked-out work, which is what a CPU wants (its per-op overhead is small next to the work).
    ``varlen``: one call over the packed rows of every segment, against all their sessions' keys
    and values laid end to end, with a block-diagonal causal mask built on the device, and the
    new keys and values written into the session buffers in one multi-tensor copy. A GPU pays a
    launch per kernel (microseconds it idles through at these sizes), so a batch of B sessions
    should not cost B attention kernels per layer. The price is one copy of the keys and values
    read per layer (the sessions' buffers are separate tensors) and the masked-out scores.
    """
    return VARLEN if device.type == "cuda" else SEGMENTS


class SessionKV:
    """One session's keys and values for every layer: ``kv[layer, 0|1, head, position, dim]``."""

    __slots__ = ("kv", "length", "_shape", "_dtype", "_device")

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self._shape = (layers, 2, kv_heads, head_dim)
        self._dtype, self._device = dtype, device
        self.kv: torch.Tensor | None = None
        self.length = 0  # leading positions that hold valid keys/values

    @property
    def capacity(self) -> int:
        return 0 if self.kv is None else self.kv.shape[3]

    def capacity_for(self, tokens: int, limit: int) -> int:
        """The capacity :meth:`ensure` would allocate to hold ``tokens`` positions (never more than
        ``limit``, the longest sequence a session may reach, unless ``tokens`` itself is more)."""
        if tokens <= self.capacity:
            return self.capacity
        grown = max(tokens, self.capacity + min(max(self.capacity, GROW_MIN), GROW_MAX))
        return max(tokens, min(-(-grown // GROW_MIN) * GROW_MIN, limit))

    def ensure(self, tokens: int, limit: int) -> None:
        """Make room for ``tokens`` positions, keeping the first ``length``."""
        capacity = self.capacity_for(tokens, limit)
        if capacity == self.capacity:
            return
        layers, two, heads, dim = self._shape
        kv = torch.empty((layers, two, heads, capacity, dim), dtype=self._dtype, device=self._device)
        if self.kv is not None and self.length:
            kv[:, :, :, : self.length] = self.kv[:, :, :, : self.length]
        self.kv = kv

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def commit(self, length: int) -> None:
        self.length = length

    def clear(self) -> None:
        self.kv, self.length = None, 0

    def free(self) -> None:
        self.clear()


@dataclass
class Segment:
    """One session's rows in a packed batch."""

    kv: SessionKV
    start: int  # position of the segment's first new token (= cached tokens)
    rows: int  # new tokens of this session in the batch
    offset: int  # index of its first row in the packed batch
    mask: torch.Tensor | None = None  # [rows, start + rows] bool, None for a single row


class RaggedBatch:
    """The ``past_key_values`` of a packed forward: writes each segment's new keys/values into its
    session's buffer, and carries the segments to :func:`ragged_attention` (``path``: see
    :func:`attention_path`)."""

    is_compileable = False

    def __init__(self, segments: list[Segment], path: str = SEGMENTS) -> None:
        if path not in ATTENTION_PATHS:
            raise ValueError(f"attention path must be one of {ATTENTION_PATHS}, got {path!r}")
        self.segments = segments
        self.path = path
        self.mask: torch.Tensor | None = None  # varlen: [T, S] bool, see _varlen_mask
        if path == VARLEN:
            self.mask = _varlen_mask(segments)
            return
        for seg in segments:
            if seg.rows > 1:
                total = seg.start + seg.rows
                # row i (position start + i) sees positions 0 .. start + i
                seg.mask = torch.ones(seg.rows, total, dtype=torch.bool, device=seg.kv.kv.device).tril(diagonal=seg.start)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: [1, kv_heads, T, head_dim] of the packed rows."""
        if self.path == VARLEN:
            # one multi-tensor copy for every segment's keys and values (one launch on CUDA, not 2 per session)
            dst, src = [], []
            for seg in self.segments:
                end, lo, hi = seg.start + seg.rows, seg.offset, seg.offset + seg.rows
                dst += [seg.kv.kv[layer_idx, 0, :, seg.start : end], seg.kv.kv[layer_idx, 1, :, seg.start : end]]
                src += [key_states[0, :, lo:hi], value_states[0, :, lo:hi]]
            torch._foreach_copy_(dst, src)
            return key_states, value_states
        for seg in self.segments:
            end = seg.start + seg.rows
            seg.kv.kv[layer_idx, 0, :, seg.start : end] = key_states[0, :, seg.offset : seg.offset + seg.rows]
            seg.kv.kv[layer_idx, 1, :, seg.start : end] = value_states[0, :, seg.offset : seg.offset + seg.rows]
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come from position_ids; nothing asks for one length of a ragged batch


def _varlen_mask(segments: list[Segment]) -> torch.Tensor:
    """[T, S] bool for the varlen path: packed row r (segment i, position p in its session) sees key
    column c iff c holds one of segment i's keys at a position <= p. The keys are the segments'
    buffers laid end to end (segment i's first start_i + rows_i positions), and the rows must be
    packed in segment order (each segment's rows right after the previous one's). Built on the
    buffers' device from one small host-to-device copy; the sizes passed as ``output_size`` keep it
    free of device syncs."""
    rows = 0
    for seg in segments:
        if seg.offset != rows:
            raise ValueError(f"segments must be packed in order: a segment starts at row {seg.offset}, not {rows}")
        rows += seg.rows
    device = segments[0].kv.kv.device
    keys = sum(seg.start + seg.rows for seg in segments)
    counts, ends, starts = torch.tensor([[seg.rows for seg in segments], [seg.start + seg.rows for seg in segments],
                                         [seg.start for seg in segments]], dtype=torch.long, device=device).unbind()
    ids = torch.arange(len(segments), device=device)
    row_seg = ids.repeat_interleave(counts, output_size=rows)  # [T] segment of each packed row
    key_seg = ids.repeat_interleave(ends, output_size=keys)  # [S] segment of each key column
    row_pos = torch.arange(rows, device=device) - (counts.cumsum(0) - counts)[row_seg] + starts[row_seg]
    key_pos = torch.arange(keys, device=device) - (ends.cumsum(0) - ends)[key_seg]
    return (row_seg[:, None] == key_seg[None, :]) & (key_pos[None, :] <= row_pos[:, None])


def ragged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     specdec_batch: RaggedBatch | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of each segment's rows over its own session's keys and values.

    query: [1, heads, T, head_dim]. Returns ([1, T, heads, head_dim], None), the layout of
    transformers' attention functions.
    """
    if specdec_batch is None:
        raise RuntimeError(f"the {ATTENTION} attention needs a RaggedBatch (run the model through specdec.model.ragged)")
    layer = module.layer_idx
    heads, dim = query.shape[1], query.shape[3]
    if specdec_batch.path == VARLEN:
        views = [seg.kv.kv[layer, :, :, : seg.start + seg.rows] for seg in specdec_batch.segments]
        kv = views[0] if len(views) == 1 else torch.cat(views, dim=2)  # [2, kv_heads, S, head_dim]
        o = F.scaled_dot_product_attention(query, kv[0:1], kv[1:2], attn_mask=specdec_batch.mask, scale=scaling,
                                           enable_gqa=kv.shape[1] != heads)
        return o.transpose(1, 2).contiguous(), None
    out = query.new_empty((1, query.shape[2], heads, dim))
    for seg in specdec_batch.segments:
        end = seg.start + seg.rows
        q = query[:, :, seg.offset : seg.offset + seg.rows]
        k = seg.kv.kv[layer, 0, :, :end].unsqueeze(0)
        v = seg.kv.kv[layer, 1, :, :end].unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=seg.mask, scale=scaling, enable_gqa=k.shape[1] != heads)
        out[0, seg.offset : seg.offset + seg.rows] = o[0].transpose(0, 1)
    return out, None


def _register() -> None:
    from transformers import AttentionInterface

    # Only the attention function is registered, not a mask function: transformers then builds no
    # causal mask for this implementation (the segments carry their own).
    AttentionInterface.register(ATTENTION, ragged_attention)


_register()


@contextlib.contextmanager
def ragged_attention_on(model: Any) -> Iterator[None]:
    """Switch ``model`` to :func:`ragged_attention` for the duration (other callers of the same
    model object, such as ``generate``, keep its own implementation)."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous


def kv_geometry(model: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder-only transformers model."""
    config = model.config
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(layers), int(kv_heads), int(head_dim)
