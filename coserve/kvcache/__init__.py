"""Paged KV-cache bookkeeping: integer block ids only, no tensors."""

from coserve.kvcache.block_manager import BlockManager, OutOfBlocks, block_key

__all__ = ["BlockManager", "OutOfBlocks", "block_key"]
