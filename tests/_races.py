"""Deposed writers' files that appear at the worst moment (tests of the claim and recovery)."""

from __future__ import annotations

import threading
from typing import List, Sequence, Union

from pyspark_acs.errors import StoreError
from pyspark_acs.format.names import next_file_name
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.write.shard import ShardWriter


def later_files_at_first_open(monkeypatch, target: Union[ShardWriter, type], writer_ids: Sequence[str],
                              *, shard: int = 0, refuse_first: bool = False) -> List[str]:
    """Right after ``target`` (one ShardWriter, or the class: every writer of ``shard``, as the
    sink makes one per commit) opens its first file, empty files named after it by the
    deposed writers ``writer_ids`` appear, each sorting after the one before: created while
    its writer stalled, which then died before its claim could seal them.

    ``refuse_first``: the store refuses to open the first of them for append, as HDFS does
    while the dead writer's stream still holds the file.

    Returns the names, filled in once they appear.
    """
    late: List[str] = []
    on_class = isinstance(target, type)
    original = target._open

    def appear(writer: ShardWriter, name: str) -> None:
        if late or writer.shard != shard:
            return
        for writer_id in writer_ids:
            late.append(next_file_name([late[-1] if late else name], writer_id))
            writer.store.write_small(f"{writer.dir}/{late[-1]}", b"")

    if on_class:
        def open_on_class(self, name, length, index):
            original(self, name, length, index)
            appear(self, name)

        monkeypatch.setattr(ShardWriter, "_open", open_on_class)
    else:
        def open_on_writer(name, length, index):
            original(name, length, index)
            appear(target, name)

        monkeypatch.setattr(target, "_open", open_on_writer)
    if refuse_first:
        appender = DurableStore.open_appender

        def refusing(self, rel):
            if late and rel.endswith(late[0]):
                raise StoreError(f"open {rel} for append: AlreadyBeingCreatedException (simulated)")
            return appender(self, rel)

        monkeypatch.setattr(DurableStore, "open_appender", refusing)
    return late


def stall_at_next_lease_check(writer: ShardWriter) -> threading.Event:
    """Make ``writer``'s thread stall at its next lease check (a writer stopped or hung past
    its lease, its file left as it was) until the returned event is set; the check then runs
    as usual (and finds the lease taken over)."""
    resumed = threading.Event()
    check = writer.check_leases

    def stalled(every: bool = False) -> None:
        resumed.wait(30)
        check(every=every)

    writer.check_leases = stalled
    return resumed
