"""tests/helpers.py start_query: a query is started again only for Spark's planner start-up fault.

The fault itself (Spark's Python planner process not connecting back within 10 s) cannot be
caused on purpose, so these tests drive the helper with stand-ins for the writer and the query
that follow pyspark's StreamingQuery interface (isActive, status, exception, name).
"""

from __future__ import annotations

import pytest

from tests.helpers import SPARK_WORKER_START_FAULT, start_query


def _no_pause(seconds: float) -> None:
    """The pause between attempts, skipped: these tests check which query comes back."""


class _Query:
    def __init__(self, active: bool, error: str = "", message: str = "Waiting for data to arrive"):
        self.isActive = active
        self.status = {"message": message}
        self._error = error
        self.name = "q"

    def exception(self):
        return RuntimeError(self._error) if self._error else None


class _Writer:
    def __init__(self, *queries: _Query):
        self.queries = list(queries)
        self.starts = 0

    def start(self):
        self.starts += 1
        return self.queries.pop(0)


def test_the_planner_start_fault_starts_the_query_again_with_a_warning():
    good = _Query(active=True)
    writer = _Writer(_Query(active=False, error=f"{SPARK_WORKER_START_FAULT}. Read timed out",
                            message="Initializing sources"), good)
    with pytest.warns(UserWarning, match="did not connect back"):
        assert start_query(writer, sleep=_no_pause) is good
    assert writer.starts == 2


class _Starting:
    """A query that reads as Spark's does right after ``start()`` (its thread not yet begun) for
    the first ``reads`` looks at its status, then as failed with the planner fault."""

    name = "q"

    def __init__(self, reads: int):
        self._reads = reads

    @property
    def isActive(self):
        return self._reads >= 0

    @property
    def status(self):
        self._reads -= 1
        return {"message": "Initializing StreamExecution" if self.isActive else "Initializing sources"}

    def exception(self):
        return None if self.isActive else RuntimeError(SPARK_WORKER_START_FAULT)


def test_a_query_not_yet_past_its_first_status_is_waited_for_before_it_counts_as_started():
    good = _Query(active=True)
    writer = _Writer(_Starting(reads=3), good)
    with pytest.warns(UserWarning, match="did not connect back"):
        assert start_query(writer, sleep=_no_pause) is good
    assert writer.starts == 2


@pytest.mark.parametrize("query", [
    _Query(active=False, error="AcsOptionError: option 'maxRowsPerTrigger' must be a positive integer"),
    _Query(active=False),  # an AvailableNow query that already finished
    _Query(active=True),
])
def test_any_other_outcome_is_the_test_s_to_see(query):
    writer = _Writer(query, _Query(active=True))
    assert start_query(writer, sleep=_no_pause) is query
    assert writer.starts == 1


def test_the_fault_every_time_returns_the_failed_query_after_the_last_attempt():
    failed = [_Query(active=False, error=SPARK_WORKER_START_FAULT) for _ in range(3)]
    writer = _Writer(*failed)
    with pytest.warns(UserWarning):
        assert start_query(writer, attempts=3, sleep=_no_pause) is failed[-1]
    assert writer.starts == 3
