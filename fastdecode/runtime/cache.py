"""An explicit, preallocated KV cache with one length pointer per layer (rollback = moving the pointer).

``KVCache`` (the reference) returns each layer's filled prefix; ``StaticKVCache`` keeps every shape fixed for
``torch.compile`` and CUDA graphs. Both keep a slot-validity mask for padded and ragged rows, a block mask
for token trees, and ``layer_mask``, the one place attention masks are made. HF attention modules write into
the cache through ``update``. Why per-layer lengths and the masks: docs/design/runtime.md.
"""

from __future__ import annotations

import torch

CAPACITY_BUCKET = 256  # static caches round their capacity up to a multiple of this


class KVCache:
    """Keys/values of every layer: ``k[l], v[l]`` are ``[B, H_kv, capacity, D]``; ``lengths[l]`` is an int.

    Args:
        num_layers: decoder layers of the model.
        batch_size: rows B.
        num_kv_heads, head_dim: attention geometry (per layer, identical across layers).
        capacity: slots preallocated; the buffers grow (doubling) if a write goes past it.
        dtype, device: of the buffers (the model's).
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        capacity = self.rounded_capacity(capacity)
        shape = (batch_size, num_kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * num_layers
        # [B, capacity] bool: which slots each row may attend to (False = padding or a rejected token).
        self.key_valid = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        # [B, capacity] position of the token in each slot: sliding windows count positions, not slots, which
        # differ once a row has holes.
        self.key_pos = torch.zeros(batch_size, capacity, dtype=torch.long, device=device)
        # Counts of tokens written per layer; tests use them to prove each token passes each layer once.
        self.writes = [0] * num_layers
        # (first slot, [B, W, W] bool) while a token tree is verified (``speculative.verify``): among the W
        # slots from the first, a query attends only to the keys this block mask allows (its ancestors)
        self.block: tuple[int, torch.Tensor] | None = None
        self._rows: tuple | None = None  # query_rows' last answer: (mask, (steps, span), rows)
        self._allocated()

    @staticmethod
    def rounded_capacity(capacity: int) -> int:
        """The capacity allocated for ``capacity`` slots (the static mode rounds it up to a bucket)."""
        return capacity

    def _allocated(self) -> None:
        """Called once the buffers exist (the static mode marks their addresses static)."""

    @property
    def capacity(self) -> int:
        return self.key_valid.shape[1]

    @property
    def batch_size(self) -> int:
        return self.key_valid.shape[0]

    def _grow(self, needed: int) -> None:
        new_cap = max(needed, 2 * self.capacity)
        pad = new_cap - self.capacity
        self.k = [torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in self.k]
        self.v = [torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in self.v]
        self.key_valid = torch.nn.functional.pad(self.key_valid, (0, pad))
        self.key_pos = torch.nn.functional.pad(self.key_pos, (0, pad))

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key/value [B, H_kv, T, D]`` at layer ``layer_idx``; return all its keys/values so far.

        The extra arguments of HF's cache protocol (cache kwargs) are accepted and ignored.
        """
        start = self.lengths[layer_idx]
        steps = key.shape[-2]
        end = start + steps
        if end > self.capacity:
            self._grow(end)
        keys, values = self.k[layer_idx], self.v[layer_idx]
        keys.narrow(2, start, steps).copy_(key)
        values.narrow(2, start, steps).copy_(value)
        self.lengths[layer_idx] = end
        self.writes[layer_idx] += steps
        return keys.narrow(2, 0, end), values.narrow(2, 0, end)

    def reserve(self, valid: torch.Tensor, start: int, positions: torch.Tensor | None = None) -> None:
        """Before tokens enter slots ``[start, start + T)``: their validity ``valid [B, T]`` (bool) and
        positions ``[B, T]`` (default: the slot indices)."""
        end = start + valid.shape[1]
        if end > self.capacity:
            self._grow(end)
        self.key_valid[:, start:end] = valid
        if positions is None:
            positions = torch.arange(start, end, device=valid.device).expand_as(valid)
        self.key_pos[:, start:end] = positions

    def crop(self, length: int, layers: range | None = None) -> None:
        """Roll back: keep only the first ``length`` slots of ``layers`` (all by default). No data moves."""
        for layer in layers if layers is not None else range(len(self.lengths)):
            self.lengths[layer] = min(self.lengths[layer], length)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` ([b] long indices, in that order): finished rows stop costing compute.
        Copies the kept rows' buffers once; slot layout, lengths and write counts are unchanged."""
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]
        self.key_valid = self.key_valid.index_select(0, rows)
        self.key_pos = self.key_pos.index_select(0, rows)

    def reorder(self, start: int, order: torch.Tensor) -> None:
        """Permute slots ``[start, start + n)`` per row: slot ``start + i`` takes what slot ``start +
        order[:, i]`` held (``order [B, n]``, a permutation per row), in every layer's keys/values and in
        ``key_valid``/``key_pos``. Why: a verified token tree's accepted branch moves into consecutive slots
        after t, so the cache is the one plain decoding of those tokens would have left. In place (a static
        cache's buffers keep their addresses)."""
        n = min(order.shape[1], self.capacity - start)
        if n <= 0:
            return
        order = order[:, :n]
        slots = start + order  # [B, n]
        for buffers in (self.k, self.v):
            for buffer in buffers:
                index = slots[:, None, :, None].expand(-1, buffer.shape[1], -1, buffer.shape[3])
                buffer.narrow(2, start, n).copy_(buffer.gather(2, index))
        for row_state in (self.key_valid, self.key_pos):
            row_state.narrow(1, start, n).copy_(row_state.gather(1, slots))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """HF-compatible name for ``lengths[layer_idx]``."""
        return self.lengths[layer_idx]

    # Hooks of the layer-range protocol (``EarlyExitModel.run_layers``): the dynamic cache advances its
    # pointers in ``update`` itself and attends to the filled prefix.
    static = False

    def begin(self, start: int, steps: int) -> None:
        """Before a layer range writes ``steps`` slots from ``start`` (nothing to do here)."""

    def finish(self, layers: range, steps: int) -> None:
        """After a layer range wrote ``steps`` slots (nothing to do here: ``update`` advanced the pointers)."""

    def attended(self, end: int) -> int:
        """How many slots attention spans when the filled prefix ends at ``end``."""
        return end

    def query_rows(self, mask: torch.Tensor | None, steps: int, span: int) -> list | None:
        """For ``steps`` queries at the last slots of ``span``: each one's (keys, mask) as a one-query step at
        its slot has them, for attention computed one query at a time, bitwise as decoding one token does
        (the 4-bit path). Keys: the slots it attends (a chain: its prefix, or in the static mode all of them;
        a token tree, one row: the prefix and its ancestors, as an index); mask: its row of ``mask``, or None
        where that step needs none (``layer_mask``). None where no step computes it so (a tree in a batch or
        in the static mode). Memoised per mask: every layer of a forward shares it."""
        found = self._rows
        if found is not None and found[0] is mask and found[1] == (steps, span):
            return found[2]
        if self.block is not None and (self.static or self.batch_size > 1):
            rows = None
        elif self.block is not None:
            rows = self._tree_rows(mask, steps)
        else:
            rows = []
            for i in range(steps):
                end = span if self.static else span - steps + i + 1
                row = None if mask is None else mask[:, :, i : i + 1, :end]
                if (
                    row is not None
                    and _maskless(self, end - 1, 1, None, causal=True)
                    and not (row != 0).any()
                ):
                    row = None
                rows.append((end, row))
        self._rows = (mask, (steps, span), rows)
        return rows

    def _tree_rows(self, mask: torch.Tensor | None, steps: int) -> list:
        """``query_rows`` of a token tree's nodes (one row): the prefix slots and the node's ancestors (itself
        included), in slot order: the cache a one-token step of that branch would hold."""
        first, among = self.block
        prefix = torch.arange(first, device=among.device)
        rows = []
        for i in range(steps):
            keys = torch.cat([prefix, first + among[0, i].nonzero().flatten()])
            row = None if mask is None else mask[:, :, i : i + 1].index_select(3, keys)
            if row is not None and bool(self.key_valid[0].index_select(0, keys).all()):
                row = None
            rows.append((keys, row))
        return rows


class StaticKVCache(KVCache):
    """The static-shape mode: same buffers, validity, positions and pointers as ``KVCache``, but ``update``
    writes at the slots of a device index tensor and returns the whole buffers; the mask covers the whole
    capacity. Capacity is rounded up to a multiple of ``CAPACITY_BUCKET``.

    Why masking by slot is exact: a query at slot q attends to slots s <= q only (causality), and every slot
    below q holds a key written by this or an earlier step; slots beyond the pointer are never attended to, so
    a rollback needs no clearing. Masked slots contribute exactly zero (the mask is the dtype's minimum).
    """

    static = True
    slots: torch.Tensor | None = None  # [T] long on the device: where ``update`` writes

    @staticmethod
    def rounded_capacity(capacity: int) -> int:
        return -(-capacity // CAPACITY_BUCKET) * CAPACITY_BUCKET

    def _allocated(self) -> None:
        self._mark_static()

    def _mark_static(self) -> None:
        """CUDA graphs (``torch.compile(mode="reduce-overhead")``) replay writes into these buffers in place:
        their addresses must be fixed inputs of the graph."""
        if self.key_valid.device.type == "cuda":
            for buffer in (*self.k, *self.v):
                torch._dynamo.mark_static_address(buffer)

    def _grow(self, needed: int) -> None:
        super()._grow(needed)
        self._mark_static()

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self._mark_static()

    def begin(self, start: int, steps: int) -> None:
        end = start + steps
        if end > self.capacity:
            self._grow(-(-end // CAPACITY_BUCKET) * CAPACITY_BUCKET)  # a new shape: recompiles once
        self.slots = torch.arange(start, end, device=self.key_valid.device)

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key/value [B, H_kv, T, D]`` of layer ``layer_idx`` at ``slots`` (set by ``begin``); return
        the layer's whole buffers. The pointers move in ``finish`` (no host state changes in here, so a
        compiled layer range has none)."""
        self.k[layer_idx].index_copy_(2, self.slots, key)
        self.v[layer_idx].index_copy_(2, self.slots, value)
        return self.k[layer_idx], self.v[layer_idx]

    def finish(self, layers: range, steps: int) -> None:
        for layer in layers:
            self.lengths[layer] += steps
            self.writes[layer] += steps

    def attended(self, end: int) -> int:
        return self.capacity


def attention_mask(
    key_valid: torch.Tensor,
    query_start: int,
    num_queries: int,
    dtype: torch.dtype,
    window: int | None = None,
    *,
    key_pos: torch.Tensor | None = None,
    query_pos: torch.Tensor | None = None,
    block: tuple[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Additive attention mask ``[B, 1, T, S]`` for queries at slots ``query_start .. query_start+T-1``.

    ``key_valid`` is ``[B, S]`` (the slots attended to). A query at slot q attends to key slot s iff the slot
    is valid for its row, ``s <= q`` (causal) and, with a sliding ``window``, the key is less than ``window``
    positions back: by ``query_pos [B, T]`` and ``key_pos [B, S]`` when given (a cache with holes), else by
    slot distance. ``block`` ``(first slot, [B, W, W] bool)``: the queries are exactly those W slots (a token
    tree's verification, ``KVCache.block``) and among them attend only where the block allows. Blocked
    entries are the dtype's minimum (not -inf): a fully masked padding row has no NaN.
    """
    num_keys = key_valid.shape[1]
    device = key_valid.device
    q = torch.arange(query_start, query_start + num_queries, device=device)[:, None]  # [T, 1]
    s = torch.arange(num_keys, device=device)[None, :]  # [1, S]
    allowed = (s <= q)[None, None] & key_valid[:, None, None, :]  # [B, 1, T, S]
    if window is not None and key_pos is not None and query_pos is not None:
        allowed = allowed & (query_pos[:, None, :, None] - key_pos[:, None, None, :] < window)
    elif window is not None:
        allowed = allowed & (s > q - window)[None, None]
    if block is not None:
        first, among = block
        if first != query_start or among.shape[1] != num_queries:
            raise ValueError(
                f"a block mask over slots [{first}, {first + among.shape[1]}) but queries at slots "
                f"[{query_start}, {query_start + num_queries})"
            )
        allowed[:, 0, :, first : first + num_queries] &= among
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def layer_mask(
    hidden: torch.Tensor,
    cache: KVCache | None,
    past: int,
    window: int | None,
    position_ids: torch.Tensor,
    *,
    sdpa: bool,
    engine_lean: bool | None = None,
) -> torch.Tensor | None:
    """The additive mask ``[B, 1, T, S]`` a layer attends with, for the queries of ``hidden [B, T, H]`` at
    positions ``position_ids [B, T]``: at slots ``past ..`` of ``cache`` (from its validity), or without a
    cache causally within the T positions. None where attention needs no materialised mask.

    ``sdpa``: the HF layers run SDPA, which applies causality itself (``is_causal``) when given no mask;
    ``engine_lean``: whether the running engine's layers are lean (None: no engine runs, and a cache always
    gets a mask).
    """
    num_queries = hidden.shape[1]
    if cache is None:
        if num_queries == 1 or (window is None and sdpa):
            return None
        valid = torch.ones(hidden.shape[0], num_queries, dtype=torch.bool, device=hidden.device)
        return attention_mask(valid, 0, num_queries, hidden.dtype, window)
    if engine_lean is not None and _maskless(cache, past, num_queries, window, causal=engine_lean or sdpa):
        return None
    span = cache.attended(past + num_queries)
    key_pos = cache.key_pos[:, :span] if window is not None else None
    return attention_mask(
        cache.key_valid[:, :span],
        past,
        num_queries,
        hidden.dtype,
        window,
        key_pos=key_pos,
        query_pos=position_ids,
        block=cache.block,
    )


def _maskless(cache: KVCache, past: int, steps: int, window: int | None, *, causal: bool) -> bool:
    """Whether the queries need no materialised mask: a dynamic cache on the CPU (where checking is free)
    with every slot valid, no sliding window, and one query (full attention) or a causal block from slot
    0 (``causal``: the layers apply causality themselves without a mask, SDPA's ``is_causal`` or the lean
    layers; HF's eager attention does not); never while a token tree's block mask is set."""
    if cache.block is not None:
        return False
    if cache.static or window is not None or cache.key_valid.device.type != "cpu":
        return False
    if steps > 1 and (past != 0 or not causal):
        return False
    return bool(cache.key_valid[:, : past + steps].all())
