"""Which loads are over and which of them failed, from the workers' reports as vLLM aggregates them.

vLLM names a request in ``finished_recving`` once every rank is over with its asynchronous load, but it passes on
each rank's ``invalid_block_ids`` in the step that rank reported them: under tensor or pipeline parallelism a
rank whose load failed may report so a step or more before the last rank is over. A failure is therefore held for
its request until the request's load is over, and counted once per load however many ranks report it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping


class LoadReports:
    def __init__(self) -> None:
        # asynchronous loads not yet reported over: request -> the blocks it loads into
        self._in_flight: dict[str, frozenset[int]] = {}
        # the synchronous loads of the step built last, reported over with that step's output
        self._in_step: dict[str, frozenset[int]] = {}
        # blocks reported damaged of asynchronous loads still in flight
        self._failed_in_flight: dict[str, set[int]] = {}

    def start_async(self, req_id: str, blocks: frozenset[int]) -> None:
        self._in_flight[req_id] = blocks

    def start_step(self, sync_loads: Mapping[str, frozenset[int]]) -> None:
        """The synchronous loads of the step just built (their reports come with its output)."""
        self._in_step = dict(sync_loads)

    def any_in_flight(self) -> bool:
        return bool(self._in_flight)

    def in_flight(self, req_id: str) -> bool:
        return req_id in self._in_flight

    def report(self, finished_recving: Collection[str], invalid_block_ids: Collection[int]) -> dict[str, set[int]]:
        """One step's aggregated report. Returns the requests whose loads are over and failed, each with the
        blocks of its load that did not arrive intact."""
        invalid = set(invalid_block_ids)
        for req_id, blocks in self._in_flight.items():
            if req_id not in finished_recving and not invalid.isdisjoint(blocks):
                self._failed_in_flight.setdefault(req_id, set()).update(invalid & blocks)
        over = {req_id: self._in_flight.pop(req_id, frozenset()) for req_id in finished_recving}
        over.update(self._in_step)
        self._in_step = {}
        failed = {}
        for req_id, blocks in over.items():
            damaged = (invalid & blocks) | self._failed_in_flight.pop(req_id, set())
            if damaged:
                failed[req_id] = damaged
        return failed
