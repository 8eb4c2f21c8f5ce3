"""A state's allowed tokens by a walk of the vocabulary trie one level at a time, in array operations.

Walking the trie node by node in Python costs a dictionary lookup per edge: about 20-40 ms for a state inside a
patterned string, where most bytes are allowed and nearly every one of an 8,192-token vocabulary's edges is
visited, and proportionally more for the 32k-150k vocabularies of real models. Here the trie is flat arrays
(``FlatTrie``), machine states are interned to small integers whose byte steps fill a table lazily
(``StateTable``: each (state, byte) pair is stepped by the machine once), and a walk advances all the live
(node, state) pairs of one trie level together: a few array operations a level. What it returns is exactly what
the node-by-node walk returns: the tokens every byte of which the machine takes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from coserve.guided.machine import State
from coserve.guided.vocab import TrieNode

UNKNOWN, DEAD = -2, -1  # table entries: not stepped yet; the machine refuses the byte


class FlatTrie:
    """A trie's nodes numbered breadth-first (the root 0), each node's children a contiguous run of edges."""

    def __init__(self, root: TrieNode) -> None:
        nodes = [root]
        first_edge, edge_count, edge_byte, edge_child, ids_start, ids = [], [], [], [], [], []
        i = 0
        while i < len(nodes):  # nodes grows as the walk numbers children
            node = nodes[i]
            first_edge.append(len(edge_byte))
            edge_count.append(len(node.children))
            for b, child in node.children.items():
                edge_byte.append(b)
                edge_child.append(len(nodes))
                nodes.append(child)
            ids_start.append(len(ids))
            ids.extend(node.ids)
            i += 1
        ids_start.append(len(ids))
        self.first_edge = np.array(first_edge, dtype=np.int64)
        self.edge_count = np.array(edge_count, dtype=np.int64)
        self.edge_byte = np.array(edge_byte, dtype=np.int64)
        self.edge_child = np.array(edge_child, dtype=np.int64)
        self.ids_start = np.array(ids_start, dtype=np.int64)
        self.ids = np.array(ids, dtype=np.int64)
        self.num_nodes = len(nodes)


class StateTable:
    """Machine states as integers, and ``[states, 256]`` byte steps between them, filled as walks need them."""

    def __init__(self, step: Callable[[State, int], State], max_states: int = 1 << 16) -> None:
        self._step = step
        self.max_states = max_states  # beyond it the table starts over at the next walk (256 int32 a state)
        self.clear()

    def clear(self) -> None:
        self._ids: dict[State, int] = {}
        self._states: list[State] = []
        self.table = np.full((64, 256), UNKNOWN, dtype=np.int32)

    def __len__(self) -> int:
        return len(self._states)

    def intern(self, state: State) -> int:
        """The integer of a live state (``DEAD`` for the empty one)."""
        if not state:
            return DEAD
        sid = self._ids.get(state)
        if sid is None:
            sid = self._ids[state] = len(self._states)
            self._states.append(state)
            if sid >= len(self.table):
                grown = np.full((2 * len(self.table), 256), UNKNOWN, dtype=np.int32)
                grown[:len(self.table)] = self.table
                self.table = grown
        return sid

    def steps(self, sids: np.ndarray, data: np.ndarray) -> np.ndarray:
        """The states after byte ``data[k]`` from state ``sids[k]`` (``DEAD`` where refused)."""
        after = self.table[sids, data]
        unknown = after == UNKNOWN
        if unknown.any():
            pairs = np.unique(sids[unknown] * 256 + data[unknown])
            new_sids, new_bytes = pairs // 256, pairs % 256
            states, step, intern = self._states, self._step, self.intern
            stepped = [intern(step(states[sid], b)) for sid, b in zip(new_sids.tolist(), new_bytes.tolist())]
            self.table[new_sids, new_bytes] = stepped  # (the table may have grown while they were interned)
            after = self.table[sids, data]
        return after


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])``."""
    total = int(counts.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - counts), counts)


def walk(trie: FlatTrie, table: StateTable, state: State) -> np.ndarray:
    """The ids of the tokens whose every byte the machine takes from ``state``, in no particular order."""
    if len(table) > table.max_states:
        table.clear()
    sid = table.intern(state)
    if sid == DEAD:
        return np.zeros(0, dtype=np.int64)
    nodes = np.zeros(1, dtype=np.int64)
    sids = np.full(1, sid, dtype=np.int64)
    reached = []
    while nodes.size:
        counts = trie.edge_count[nodes]
        edges = _ranges(trie.first_edge[nodes], counts)
        if not edges.size:
            break
        after = table.steps(np.repeat(sids, counts), trie.edge_byte[edges])
        alive = after != DEAD
        nodes, sids = trie.edge_child[edges[alive]], after[alive].astype(np.int64)
        reached.append(nodes)
        inner = trie.edge_count[nodes] > 0
        nodes, sids = nodes[inner], sids[inner]
    if not reached:
        return np.zeros(0, dtype=np.int64)
    hit = np.concatenate(reached)
    return trie.ids[_ranges(trie.ids_start[hit], trie.ids_start[hit + 1] - trie.ids_start[hit])]
