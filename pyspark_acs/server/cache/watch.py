"""Push streams of one cache replica: readers are told, instead of asking (docs/cache.md).

Two kinds of long-lived streams, one per (reader process, replica), each carrying many keys
or files:

- **Watch** (metadata replicas): the reader names keys (published lengths); every put that
  stores a newer entry of a watched key marks it, and the stream sends the newest entries of
  all marked keys in one message.
- **Follow** (data replicas): the reader names files (the 16-byte file id of their chunk keys,
  :func:`pyspark_acs.cache.chunks.chunk_key`) with a byte offset each; every chunk put of a
  followed file marks it, and the stream sends the file's bytes from its cursor as far as this
  replica holds them contiguously, then moves the cursor. A caught-up reader thus receives each
  new byte once, with no request.

Both are *level-triggered*: a mark says "look again", and the sender reads the store when it
sends. A stream therefore never queues entries or bytes: what it owes is a set of marked keys
or files and their cursors, however slow the reader. A slow reader only holds up its own
stream (gRPC flow control suspends its sender at the ``yield``), and at most
:data:`MAX_PUSH_BYTES` are built per message. Bytes that left the store before a slow reader
got them stop its run (a missing chunk); the reader asks for them as it does without push --
unless a message kept for its cursor still holds them (below).

**One message, many followers.** Followers of a hot file stand at the same cursor after each
put (they all got the last push), so the message one of them is sent is what the next will be
sent: :meth:`Watchers.next_message` keeps the last messages of each followed file by the cursor
they start at and sends them again to a stream at that cursor, without a store read or an
encode. What makes a kept message the one :meth:`FileFollow.take` would build is that every
stored chunk of the file drops the file's kept messages (a longer prefix, or a dueling writer's
bytes at the same version, alike), and so does a ``Delete`` of one. Chunks that expire or are
evicted meanwhile do not: a kept message still carries their bytes, which are the file's (only
verified bytes reach the cache), so a reader gets a longer run than the store holds, never a
different one. Kept messages are bounded per file (:data:`SENT_KEPT_PER_FILE`) and per replica
(:data:`SENT_KEPT_BYTES`, shown as ``acs_cache_push_kept_bytes``).

Every method runs on the server's event loop thread (put handlers and stream senders alike),
so the registries need no lock.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from pyspark_acs.cache.chunks import CHUNK_SIZE, boundary_key, chunk_keys, parse_chunk_key
from pyspark_acs.server.cache.store import Store

__all__ = [
    "FileFollow",
    "KeyWatch",
    "Watchers",
]

#: Largest payload of one pushed message (bytes); more is sent in the next message.
MAX_PUSH_BYTES = 1024 * 1024
#: Chunks a Follow stream first looks up at once from a file's cursor (then twice as many, as
#: long as they are all there): a caught-up follower's push is a few chunks.
TAKE_WINDOW_CHUNKS = 8
#: Messages kept per followed file for other streams at the same cursor (each at most
#: MAX_PUSH_BYTES and its header): followers that keep up share one cursor, those behind are
#: spread, and each put of the file drops them all.
SENT_KEPT_PER_FILE = 4
#: Bytes of kept messages one replica holds at most, over all files (they are not charged to
#: the store's capacity): a message that would pass it is sent but not kept. Followers that
#: keep up need one small message per hot file (a flush's bytes); 32 followed files with
#: readers spread over four cursors each kept 133 MB without it (review reproduction).
SENT_KEPT_BYTES = 16 * 1024 * 1024

#: A pushed file's run: (file id, start, pieces, size).
Run = Tuple[bytes, int, List[bytes], int]


class KeyWatch:
    """One Watch stream: the keys it watches and those marked since its last message."""

    def __init__(self) -> None:
        self.keys: Set[bytes] = set()
        self.marked: Set[bytes] = set()
        self.wake = asyncio.Event()

    def mark(self, key: bytes) -> None:
        self.marked.add(key)
        self.wake.set()

    def take(self, store: Store) -> Tuple[List[bytes], List[Optional[Tuple[bytes, int]]]]:
        """The marked keys still watched and their current entries (value, version) or None."""
        keys = [k for k in self.marked if k in self.keys]
        self.marked.clear()
        self.wake.clear()
        entries = store.get_many(keys, count=False) if keys else []
        return keys, [(e.value, e.version) if e is not None else None for e in entries]


class FileFollow:
    """One Follow stream: a cursor per followed file and the files marked since it last sent."""

    def __init__(self) -> None:
        self.cursors: Dict[bytes, int] = {}
        #: The marked files, oldest mark first (a dict as an ordered set): a file whose run used
        #: up a message's budget goes to the back, so one file's backlog does not hold the
        #: stream's other files off until it is through.
        self.marked: Dict[bytes, None] = {}
        self.wake = asyncio.Event()

    def mark(self, fid: bytes) -> None:
        self.marked[fid] = None
        self.wake.set()

    def take(self, store: Store, budget: int = MAX_PUSH_BYTES) -> List[Run]:
        """Runs ``(file id, start, pieces, size)`` from the marked files' cursors, as far as the
        store holds each contiguously (whole chunks, then the valid prefix of the last one),
        within ``budget`` bytes; files left over stay marked. Moves the cursors. A run's bytes
        are its pieces (chunk values or their slices), not joined: the push joins every run's
        pieces once, into the message (cache/wire.py).

        The chunks are looked up a window at a time (:data:`TAKE_WINDOW_CHUNKS`, doubling),
        under one lock each: a caught-up follower's push is a few chunks, and a lookup per chunk
        is paid again for each follower of the file."""
        runs: List[Run] = []
        left = budget
        for fid in list(self.marked):
            if left <= 0:
                break
            del self.marked[fid]
            start = self.cursors.get(fid)
            if start is None:
                continue  # unfollowed since it was marked
            pos = start
            parts: List[bytes] = []
            n, skip = divmod(pos, CHUNK_SIZE)
            window = TAKE_WINDOW_CHUNKS
            more = True
            while more and left > 0:
                want = min(window, (skip + left + CHUNK_SIZE - 1) // CHUNK_SIZE)
                found, values, versions = store.read_many(chunk_keys("", range(n, n + want), file_id=fid),
                                                          count=False)
                for present, value, version in zip(found, values, versions):
                    if not present or version <= skip:
                        more = False  # not here (yet): the next put of the chunk marks the file again
                        break
                    piece = value[skip:version]
                    if len(piece) >= left:
                        # The budget ends here: what follows goes in the next message (a file
                        # whose run filled the budget exactly was left unmarked, and its next
                        # bytes waited for its next put -- for a finished file, for ever).
                        piece = piece[:left]
                        self.marked[fid] = None  # at the back: the other marked files go first
                    parts.append(piece)
                    pos += len(piece)
                    left -= len(piece)
                    if skip + len(piece) < CHUNK_SIZE:
                        more = False  # the end of what this chunk holds (or of the budget)
                        break
                    n, skip = n + 1, 0
                window *= 2
            if parts:
                self.cursors[fid] = pos
                runs.append((fid, start, parts, pos - start))
        if not self.marked:
            self.wake.clear()
        return runs


class Watchers:
    """Who watches which key and follows which file, on one replica (event loop thread only)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._by_key: Dict[bytes, Set[KeyWatch]] = {}
        self._by_file: Dict[bytes, Set[FileFollow]] = {}
        #: file id -> cursor -> (cursor after, message): what a Follow stream at that cursor of
        #: the file was last sent, while no chunk of the file was stored since
        #: (:meth:`next_message`; at most SENT_KEPT_PER_FILE per file, oldest dropped first),
        #: and the bytes of all of them (at most SENT_KEPT_BYTES).
        self._sent: Dict[bytes, Dict[int, Tuple[int, bytes]]] = {}
        self.kept_bytes = 0
        #: Counters for /metrics: streams open now, messages and bytes pushed since start.
        self.counts: Dict[str, int] = {"watch_streams": 0, "follow_streams": 0, "pushed_messages_total": 0,
                                       "pushed_bytes_total": 0, "pushed_shared_total": 0,
                                       "follow_latest_total": 0, "follow_latest_unknown_total": 0}

    @property
    def idle(self) -> bool:
        """Nobody watches or follows anything (puts skip :meth:`stored`)."""
        return not self._by_key and not self._by_file

    def stored(self, keys: Iterable[bytes]) -> None:
        """Keys a put just stored (newer entries): mark the streams that watch or follow them."""
        by_key, by_file = self._by_key, self._by_file
        for key in keys:
            watches = by_key.get(key)
            if watches:
                for w in watches:
                    w.mark(key)
            if by_file:
                parsed = parse_chunk_key(key)
                follows = by_file.get(parsed[0]) if parsed is not None else None
                if follows:
                    self._drop_sent(parsed[0])  # the file grew: what was sent is not all there is
                    for f in follows:
                        f.mark(parsed[0])

    # -- Watch -----------------------------------------------------------------------------

    def watch(self, w: KeyWatch, add: Sequence[bytes], remove: Sequence[bytes]) -> None:
        """Change what ``w`` watches; added keys are marked, so their entries go out at once."""
        for key in remove:
            w.keys.discard(key)
            s = self._by_key.get(key)
            if s is not None:
                s.discard(w)
                if not s:
                    del self._by_key[key]
        for key in add:
            w.keys.add(key)
            self._by_key.setdefault(key, set()).add(w)
            w.mark(key)

    def drop_watch(self, w: KeyWatch) -> None:
        self.watch(w, (), list(w.keys))

    # -- Follow ----------------------------------------------------------------------------

    def follow(self, f: FileFollow, files: Sequence[bytes], offsets: Sequence[int], unfollow: Sequence[bytes]) -> None:
        """Change what ``f`` follows; (re)followed files are marked, so present bytes go out at once."""
        for fid in unfollow:
            f.cursors.pop(fid, None)
            f.marked.pop(fid, None)
            s = self._by_file.get(fid)
            if s is not None:
                s.discard(f)
                if not s:
                    del self._by_file[fid]
                    self._drop_sent(fid)
        for fid, offset in zip(files, offsets):
            f.cursors[fid] = int(offset)
            self._by_file.setdefault(fid, set()).add(f)
            f.mark(fid)

    def latest(self, files: Sequence[bytes], back: int) -> Tuple[List[bytes], List[int], List[int]]:
        """Where each of ``files`` is followed from at ``latest``: its last block boundary here
        (its :func:`~pyspark_acs.cache.chunks.boundary_key`'s version), less ``back`` bytes.
        Returns the files that have one, their boundaries and the cursors; a file without one
        (no writer marked it here, or the entry expired) is left out and not followed."""
        found, ends, cursors = [], [], []
        entries = self.store.get_many([boundary_key(fid) for fid in files], count=False) if files else []
        for fid, entry in zip(files, entries):
            if entry is None:
                self.counts["follow_latest_unknown_total"] += 1
                continue
            self.counts["follow_latest_total"] += 1
            found.append(fid)
            ends.append(entry.version)
            cursors.append(max(0, entry.version - back))
        return found, ends, cursors

    def drop_follow(self, f: FileFollow) -> None:
        self.follow(f, (), (), list(f.cursors))

    def deleted(self, keys: Iterable[bytes]) -> None:
        """Keys a ``Delete`` removed: messages kept for their files go (a push then stops at
        the missing chunk, as a Get misses it)."""
        if not self._sent:
            return
        for key in keys:
            parsed = parse_chunk_key(key)
            if parsed is not None:
                self._drop_sent(parsed[0])

    def _drop_sent(self, fid: bytes) -> None:
        sent = self._sent.pop(fid, None)
        if sent:
            self.kept_bytes -= sum(len(message) for _, message in sent.values())

    def next_message(self, f: FileFollow, encode: Callable[[List[Run]], bytes]) -> Tuple[Optional[bytes], int]:
        """The next message of Follow stream ``f`` and the file bytes it carries (``None, 0``:
        nothing to send): its runs taken from the store (:meth:`FileFollow.take`) and encoded by
        ``encode``. When ``f``'s one marked file stands at a cursor from which another stream
        of the file was sent a message since the file's last stored chunk, that message again:
        the same bytes, with no store read and no encode (the module's "one message, many
        followers"). Moves ``f``'s cursors as :meth:`FileFollow.take` does."""
        fid = next(iter(f.marked)) if len(f.marked) == 1 else None
        start = f.cursors.get(fid) if fid is not None else None
        if start is not None:
            sent = self._sent.get(fid)
            hit = sent.get(start) if sent is not None else None
            if hit is not None:
                del f.marked[fid]
                f.wake.clear()
                f.cursors[fid] = hit[0]
                self.counts["pushed_shared_total"] += 1
                return hit[1], hit[0] - start
        runs = f.take(self.store)
        if not runs:
            return None, 0
        message = encode(runs)
        # Kept only when it is the whole of what the file had from ``start``: one run, and the
        # file not marked again (a run that used the budget up leaves it marked).
        if (start is not None and len(runs) == 1 and not f.marked and fid in self._by_file
                and self.kept_bytes + len(message) <= SENT_KEPT_BYTES):
            sent = self._sent.setdefault(fid, {})
            old = sent.pop(start, None)
            if old is None and len(sent) >= SENT_KEPT_PER_FILE:
                old = sent.pop(next(iter(sent)))
            if old is not None:
                self.kept_bytes -= len(old[1])
            sent[start] = (start + runs[0][3], message)
            self.kept_bytes += len(message)
        return message, sum(r[3] for r in runs)
