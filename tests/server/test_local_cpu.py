"""pyspark_acs.server.local.cpu: CPU seconds of local processes, what the demo prints per part."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pyspark_acs.server.local.cpu import cpu_measurable, cpu_seconds

pytestmark = pytest.mark.skipif(not cpu_measurable(), reason="reads Linux /proc")

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"


def test_a_process_tree_counts_its_exited_children_and_alone_does_not():
    # A parent that runs a busy child to its end, then waits to be read: the child's CPU is the
    # parent's cutime, counted with descendants and not without.
    parent = subprocess.Popen(
        [sys.executable, "-c",
         f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BUSY!r}]); print('done', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "done"
        tree = cpu_seconds([parent.pid])
        alone = cpu_seconds([parent.pid], descendants=False)
        assert tree - alone >= 0.25  # the child's 0.3 s (clock ticks are 10 ms)
    finally:
        parent.stdin.close()
        parent.wait(30)


def test_gone_processes_count_nothing():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert cpu_seconds([gone.pid]) == 0.0
    assert cpu_seconds([]) == 0.0
