"""A request's blocks in the prefix cache: the keys of its full blocks, the cached ones that can start its block
table at admission, and registering the blocks its computed tokens have filled (plain Python over a
``BlockManager``; the keys chain each block's tokens to the blocks before it and to the request's salt)."""

from __future__ import annotations

from coserve.kvcache import BlockManager, block_key
from coserve.scheduler.request import Request


def cached_prefix(blocks: BlockManager, request: Request) -> list[int]:
    """Cached blocks that can start ``request``'s table: its full blocks before its last known token (which
    must be computed for the next token's logits); none when it scores its prompt or caching is off."""
    if not blocks.enable_caching or request.params.prompt_logprobs is not None:
        return []
    return blocks.match(block_keys(request, (request.num_tokens - 1) // blocks.block_size, blocks.block_size))


def block_keys(request: Request, num_blocks: int, block_size: int) -> list[int]:
    """The prefix-cache keys of ``request``'s first ``num_blocks`` blocks (their tokens must be known), computed
    once each and kept on the request."""
    keys = request.block_keys
    salt = request.cache_salt + "\x00long" if request.long_rope else request.cache_salt  # LongRoPE's K/V differ
    while len(keys) < num_blocks:
        i = len(keys)
        keys.append(block_key(keys[-1] if keys else None,
                              tuple(request.token_ids(i * block_size, (i + 1) * block_size)), salt))
    return keys[:num_blocks]


def register_blocks(blocks: BlockManager, request: Request) -> None:
    """Register ``request``'s blocks that its computed tokens have filled since the last time."""
    full = request.num_computed_tokens // blocks.block_size
    if full > request.num_registered_blocks:
        keys = block_keys(request, full, blocks.block_size)
        for i in range(request.num_registered_blocks, full):
            blocks.register(request.request_id, i, keys[i])
        request.num_registered_blocks = full
