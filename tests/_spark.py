"""Starting streaming queries in the tests, past one start-up fault of Spark's own.

A Python streaming source is planned in a Python process that Spark starts for each query and
that must connect back to the JVM within Spark's hard-coded 10 s (``PythonWorkerFactory.
createSimpleWorker``; no setting raises it). On a loaded 2-core CI machine that connection once
timed out on both ends (the JVM waiting for the auth secret, the Python process for the reply),
and the query ended with "Python worker failed to connect back" before it had planned anything
of ours. A user restarts such a query; so does :func:`start_query`, but only for that error,
only while the query is still initializing its sources (nothing read, nothing written), and it
says so in a warning. Any other failure is the test's to see.
"""

from __future__ import annotations

import time
import warnings

__all__ = ["SPARK_WORKER_START_FAULT", "start_query"]

#: The message of Spark's ``SparkException`` when a Python worker did not connect back in time.
SPARK_WORKER_START_FAULT = "Python worker failed to connect back"

#: Status message of a query whose sources are not initialized yet (StreamExecution).
_INITIALIZING = "Initializing sources"

#: How long a query may take to initialize its sources before the start counts as done (s).
START_WAIT_S = 120.0

#: Starts per query: the fault is rare, two in a row would be a finding of its own.
START_ATTEMPTS = 3


def start_query(writer, attempts: int = START_ATTEMPTS):
    """``writer.start()``, started again if Spark's Python planner failed to connect back.

    Parameters
    ----------
    writer : pyspark.sql.streaming.DataStreamWriter
        The configured writer; ``start()`` is called on it once per attempt.
    attempts : int
        Starts at most.

    Returns
    -------
    pyspark.sql.streaming.StreamingQuery
        The query, once it is past initializing its sources (or finished).
    """
    for attempt in range(1, attempts + 1):
        query = writer.start()
        deadline = time.monotonic() + START_WAIT_S
        while (query.isActive and query.status.get("message") == _INITIALIZING
               and time.monotonic() < deadline):
            time.sleep(0.05)
        if query.isActive or attempt == attempts:
            return query
        error = query.exception()
        if error is None or SPARK_WORKER_START_FAULT not in str(error):
            return query
        warnings.warn(f"start {attempt} of query {query.name!r}: Spark's Python planner did not "
                      f"connect back ({SPARK_WORKER_START_FAULT}); starting it again")
    raise AssertionError("unreachable")
