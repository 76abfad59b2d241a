"""The K/V tensors of the paged cache.

One K and one V tensor per layer, in one of two layouts:

* ``"NHD"``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` -- a slot's heads are contiguous, so the
  cache is also a flat ``[num_slots, H, D]`` view and writes/gathers are single ``index_*`` calls;
* ``"HND"``: ``[num_blocks, num_kv_heads, block_size, head_dim]`` -- a head's slots are contiguous, the
  layout paged decode kernels prefer; here writes and gathers index (block, slot) pairs.

Both give identical results; every operation is vectorised over tokens because the engine calls them for
every layer of every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvlab.config import LAYOUTS, blocks_for


class KVStorage:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        layout: str = "NHD",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layout = layout
        self.dtype = dtype
        if layout == "NHD":
            shape = (num_blocks, block_size, num_kv_heads, head_dim)
        else:
            shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.blocks_copied = 0  # blocks copy_blocks has copied (each in every layer, K and V)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_cache + self.v_cache)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one block (its K and V in every layer), known before a pool is built."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block: its K and V in every layer, what one copy_blocks copy moves."""
        return self.bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def bytes_copied(self) -> int:
        return self.blocks_copied * self.block_nbytes

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V ``[T, Hkv, D]`` of T tokens into the slots ``slot_mapping`` ``[T]``."""
        slots = slot_mapping.to(torch.long)
        if k.shape != v.shape or k.shape[1:] != (self.num_kv_heads, self.head_dim) or k.shape[0] != slots.numel():
            raise ValueError(
                f"write expects k, v of shape [{slots.numel()}, {self.num_kv_heads}, {self.head_dim}], "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        for cache, x in ((self.k_cache[layer], k), (self.v_cache[layer], v)):
            x = x.to(self.dtype)  # an fp8 cache: rounded to nearest even (e4m3 saturating at +-448)
            if self.layout == "NHD":
                flat = cache.view(self.num_slots, self.num_kv_heads, self.head_dim)
                _bits(flat).index_copy_(0, slots, _bits(x))
            else:
                cache[slots // self.block_size, :, slots % self.block_size] = x

    def gather(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of ``slots`` of any shape S, as ``[*S, Hkv, D]`` each, in ``dtype`` (the queries' dtype when the
        cache is kept in another one, e.g. a bf16 cache under fp32 compute)."""
        slots = slots.to(torch.long)
        k, v = self._gather(self.k_cache[layer], slots), self._gather(self.v_cache[layer], slots)
        if dtype is not None and dtype != self.dtype:
            k, v = k.to(dtype), v.to(dtype)
        return k, v

    def _gather(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if self.layout == "NHD":
            flat = cache.view(self.num_slots, self.num_kv_heads, self.head_dim)
            return flat.index_select(0, slots.reshape(-1)).view(*slots.shape, self.num_kv_heads, self.head_dim)
        return cache[slots // self.block_size, :, slots % self.block_size]

    def context_slots(self, block_table: Sequence[int], length: int) -> torch.Tensor:
        """Slots of positions ``0 .. length-1`` of a request with this block table."""
        bs = self.block_size
        num = blocks_for(length, bs)
        if num > len(block_table):
            raise ValueError(f"a context of {length} tokens needs {num} blocks, the table has {len(block_table)}")
        blocks = torch.as_tensor(list(block_table[:num]), dtype=torch.long)
        return (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[:length]

    def gather_context(self, layer: int, block_table: Sequence[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of a request's first ``length`` positions, ``[length, Hkv, D]`` each."""
        return self.gather(layer, self.context_slots(block_table, length))

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write), in the order given."""
        if not copies:
            return
        self.blocks_copied += len(copies)
        src = torch.tensor([s for s, _ in copies], dtype=torch.long)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long)
        # A batch where some block is both written and read must follow list order; otherwise one
        # vectorised copy per tensor does the same.
        chained = bool(set(src.tolist()) & set(dst.tolist())) or len(set(dst.tolist())) < len(copies)
        for cache in self.k_cache + self.v_cache:
            if chained:
                for s, d in copies:
                    cache[d] = cache[s]
            else:
                _bits(cache).index_copy_(0, dst, _bits(cache).index_select(0, src))


def _bits(x: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its bytes (``index_copy_`` has no fp8 kernel on the CPU); any other as it is."""
    return x.view(torch.uint8) if x.element_size() == 1 and x.is_floating_point() else x
