"""The publisher -> subscriber graph of the workers: start order and cycles."""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._model import WorkerConfig


def edges(workers: dict[str, WorkerConfig]) -> dict[str, dict[str, str]]:
    """publisher -> {subscriber: channel} over normal (non-shadow) subscriptions."""
    writer = {ch: w.name for w in workers.values() for ch in w.publishes}
    out: dict[str, dict[str, str]] = {name: {} for name in workers}
    for w in workers.values():
        for ch in w.subscribes:
            pub = writer.get(ch)
            if pub is not None and pub != w.name:
                out[pub].setdefault(w.name, ch)
    return out


def topo_sort(workers: dict[str, WorkerConfig]) -> tuple[list[str], list[str]]:
    """Kahn's algorithm, ties broken by declaration order. Returns (order, the workers
    that could not be placed because they are on or behind a cycle)."""
    graph = edges(workers)
    rank = {name: i for i, name in enumerate(workers)}
    indegree = {name: 0 for name in workers}
    for subs in graph.values():
        for s in subs:
            indegree[s] += 1
    ready = [(rank[n], n) for n, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for s in graph[n]:
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(ready, (rank[s], s))
    placed = set(order)
    return order, [n for n in workers if n not in placed]


def cycle_through(start: str, workers: dict[str, WorkerConfig],
                  among: list[str]) -> list[tuple[str, str]] | None:
    """Shortest cycle from ``start`` back to itself as ``[(start, ""), (next, via channel),
    ..., (start, closing channel)]``, or None when ``start`` is on no cycle."""
    graph = edges(workers)
    allowed = set(among)
    parent: dict[str, tuple[str, str]] = {}   # node -> (predecessor, channel between)
    frontier = [start]
    while frontier:
        following = []
        for n in frontier:
            for s, ch in graph[n].items():
                if s == start:
                    chain = [(start, ch)]
                    while n != start:
                        prev, via = parent[n]
                        chain.append((n, via))
                        n = prev
                    return [(start, "")] + chain[::-1]
                if s in allowed and s not in parent:
                    parent[s] = (n, ch)
                    following.append(s)
        frontier = following
    return None

