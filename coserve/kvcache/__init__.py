"""Paged KV-cache bookkeeping: integer block ids only, no tensors."""

from coserve.kvcache.block_manager import BlockManager, OutOfBlocks

__all__ = ["BlockManager", "OutOfBlocks"]
