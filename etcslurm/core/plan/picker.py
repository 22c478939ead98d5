"""Where each remote slice comes from: the rule (:class:`SourcePicker`) that picks one of
the live holders of a slice, fast enough to run for every receiver at 10k devices.
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from heapq import heappop, heappush, heapreplace


class SourcePicker:
    """Chooses where each remote slice comes from, a run of slices at a time.

    The rule, per slice (a receiver's slices in its runs' order): its candidates are the
    live holders on the receiver's node, or every live holder when none is on it; the
    *best* is the least loaded (bytes given to send so far; ties to the lowest device);
    the slice goes to the source of the receiver's previous slice when that is a
    candidate whose load is at most the best's plus ``slack``, else to the best.

    Why sticky: choosing the least loaded holder for every slice balances the senders,
    but spreads one receiver's state over every holder (a pipeline stage leaving at 8k
    devices: each receiver would get ~120 messages from as many senders, and as a device
    receives one message per round, the exchange hundreds of rounds).  Keeping the
    previous source while it is within one message (``slack``: the message cap) of the
    best keeps each holder's load within a message of the least loaded one, and a
    receiver's state comes in runs of about a message each: as balanced, an order of
    magnitude fewer messages and rounds.

    Fast: a run of slices with the same holders goes to one source until the load bound
    is crossed, found by bisection in the run's prefix byte sums (``cum``); one lazy heap
    of (load, device) per holder set and per (holder set, node).  Loads only grow, so an
    entry whose load is out of date is too small: it surfaces first and is refreshed in
    place.  ``tests/test_core_planner.py`` checks the whole plan against a slice-by-slice
    linear version of the rule.
    """

    def __init__(self, node_of: list[int], n_dev: int, slack: int):
        self.node_of = node_of
        self.slack = slack
        self.load: list[int] = [0] * n_dev
        self.heaps: dict[tuple[int, int | None], list[tuple[int, int]]] = {}
        # (holder set, node) → (the heap that node picks from, the set's holders, whether
        # the heap is the node's own)
        self.chosen: dict[tuple[int, int], tuple[list[tuple[int, int]], frozenset[int],
                                                 bool]] = {}
        self.holders: dict[int, frozenset[int]] = {}
        self.by_node: dict[int, dict[int, list[int]]] = {}

    def _heap(self, s: int, node: int | None, cands: list[int]) -> list[tuple[int, int]]:
        h = self.heaps.get((s, node))
        if h is None:
            load = self.load
            if node is None:
                members = cands
            else:  # the set's holders by node, grouped once for every node that asks
                by_node = self.by_node.get(s)
                if by_node is None:
                    by_node = self.by_node[s] = defaultdict(list)
                    node_of = self.node_of
                    for d in cands:
                        by_node[node_of[d]].append(d)
                members = by_node.get(node, ())
            h = [(load[d], d) for d in members]
            heapq.heapify(h)
            self.heaps[(s, node)] = h
        return h

    def _top(self, h: list[tuple[int, int]]) -> tuple[int, int]:
        """The heap's least loaded device, its entry refreshed."""
        load = self.load
        was, d = h[0]
        cur = load[d]
        while was != cur:  # out of date (too small): refresh, look again
            heapreplace(h, (cur, d))
            was, d = h[0]
            cur = load[d]
        return was, d

    def take(self, s: int, cands: list[int], node: int, prev: int, cum: list[int],
             start: int) -> tuple[int, int]:
        """The source of slices ``start, start+1, ...`` of a run from holder set ``s``
        (live holders ``cands``) to a device on ``node`` whose previous slice came from
        ``prev``, and where its share ends: ``(source, stop)``; its load grows by the
        bytes of slices ``[start, stop)`` (``cum``: the run's prefix byte sums)."""
        ent = self.chosen.get((s, node))
        if ent is None:  # the node's heap, or the global one when no holder is on the node
            h = self._heap(s, node, cands)
            on_node = bool(h)
            h = h or self._heap(s, None, cands)
            holders = self.holders.get(s)
            if holders is None:
                holders = self.holders[s] = frozenset(cands)
            ent = self.chosen[(s, node)] = (h, holders, on_node)
        h, holders, on_node = ent
        load, slack = self.load, self.slack
        best_load, best = self._top(h)
        if (prev != best and prev in holders and (not on_node or self.node_of[prev] == node)
                and load[prev] <= best_load + slack):
            src, others, popped = prev, best_load, False
        else:
            src, popped = best, True
            heappop(h)
            others = self._top(h)[0] if h else None
        n = len(cum) - 1
        if others is None:
            stop = n
        else:  # slice k goes to src while its load before k is at most others + slack
            stop = bisect.bisect_right(cum, cum[start] + others + slack - load[src], start, n)
            stop = max(stop, start + 1)
        load[src] += cum[stop] - cum[start]
        if popped:
            heappush(h, (load[src], src))
        return src, stop
