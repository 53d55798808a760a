"""The response cache: responses every rank has agreed on, each under a small integer id.

Once a response is cached, negotiating the same request again costs one bit in the cycle's bit vector instead of
a round through the coordinator. Every rank performs the same insertions, touches and evictions in the same order
(they all follow the agreed response order), so ids agree everywhere without any extra message.
"""

from __future__ import annotations

from collections import OrderedDict

from shoal.engine.negotiation import Response
from shoal.engine.request import RequestMeta


class ResponseCache:
    """An LRU map from cache id to agreed response, indexed by this rank's own request signature and by name."""

    __slots__ = ("_by_id", "_by_name", "_by_own_meta", "_capacity", "_lru", "_rank")

    def __init__(self, capacity: int, rank: int) -> None:
        self._capacity = capacity
        self._rank = rank
        self._by_id: dict[int, Response] = {}
        self._by_own_meta: dict[RequestMeta, int] = {}
        self._by_name: dict[tuple[int, str], int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()

    @property
    def capacity(self) -> int:
        """Maximum number of entries (0: caching is off)."""
        return self._capacity

    def __len__(self) -> int:
        return len(self._by_id)

    def lookup(self, meta: RequestMeta) -> int | None:
        """The id of a cached response in which this rank asked for exactly ``meta``, or None."""
        return self._by_own_meta.get(meta)

    def id_for_name(self, process_set: int, name: str) -> int | None:
        """The id cached for a tensor name, whatever its signature."""
        return self._by_name.get((process_set, name))

    def response(self, cache_id: int) -> Response:
        """The response stored under ``cache_id``."""
        return self._by_id[cache_id]

    def ids(self) -> list[int]:
        """All ids in use, ascending."""
        return sorted(self._by_id)

    def touch(self, cache_id: int) -> None:
        """Mark an entry as just used."""
        self._lru.move_to_end(cache_id)

    def insert(self, response: Response) -> Response | None:
        """Cache ``response`` (its name must not be cached); returns the response evicted for room, if any."""
        if self._capacity == 0:
            raise ValueError("the response cache is disabled")
        key = (response.process_set, response.name)
        if key in self._by_name:
            raise ValueError(f"tensor {response.name!r} is already cached")
        evicted = None
        if len(self._by_id) >= self._capacity:
            oldest = next(iter(self._lru))
            evicted = self.evict(oldest)
        cache_id = next(i for i in range(self._capacity) if i not in self._by_id)
        self._by_id[cache_id] = response
        self._by_name[key] = cache_id
        own = response.rank_metas[self._rank]
        if own is not None:
            self._by_own_meta[own] = cache_id
        self._lru[cache_id] = None
        return evicted

    def evict(self, cache_id: int) -> Response:
        """Remove an entry and return it."""
        response = self._by_id.pop(cache_id)
        del self._by_name[(response.process_set, response.name)]
        own = response.rank_metas[self._rank]
        if own is not None:
            self._by_own_meta.pop(own, None)
        del self._lru[cache_id]
        return response
