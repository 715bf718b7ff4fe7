"""The sink's commit log: where its intents, state and batch manifests live and what they hold."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from pyspark_acs.errors import AcsError

__all__ = [
    "BatchManifest",
    "Intent",
    "Piece",
    "STATE_FILE",
    "Segment",
    "ShardState",
    "SinkState",
    "batch_manifest_rel",
    "intent_batch",
    "intent_file",
    "sink_dir",
]

#: Folder (under the root beside the streams, and under each stream) of the sink identities.
SINKS_DIR = "_sinks"
#: A stream's sink state file, in its sink folder.
STATE_FILE = "state.json"
#: The intent form this version writes: pieces as objects. 0.1.0 wrote no ``format`` (form 1:
#: pieces as positional lists ``[path, length, rows(, skip)]``); both are read.
INTENT_FORMAT = 2


def sink_dir(stream: str, sink_id: str) -> str:
    """A sink identity's folder in ``stream`` (intents, state, staging), relative to the root."""
    return f"{stream}/{SINKS_DIR}/{sink_id}"


def intent_file(batch_id: Optional[int]) -> str:
    """Name of a batch's intent in the sink folder (``intent-batch.json``: a batch write
    without ``sinkId``, which no retry looks for)."""
    return f"intent-{batch_id if batch_id is not None else 'batch'}.json"


def intent_batch(name: str) -> Optional[int]:
    """The batch id of an intent's file name (``None``: not a numbered intent)."""
    if name.startswith("intent-") and name.endswith(".json") and name[7:-5].isdigit():
        return int(name[7:-5])
    return None


def batch_manifest_rel(sink_id: str, batch_id: int) -> str:
    """Where a batch's list of streams is kept while it commits (beside the streams: a sink
    identity spans every stream it routes rows to)."""
    return f"{SINKS_DIR}/{sink_id}/batch-{batch_id}.json"


def _corrupt(where: str, exc: Exception) -> AcsError:
    return AcsError(f"{where}: corrupt sink record: {exc}")


@dataclass(frozen=True)
class Piece:
    """Bytes ``[skip, length)`` of one staged file: whole blocks holding ``rows`` messages.

    ``skip`` is non-zero only after a redirect: the bytes before it landed in an earlier file
    before another writer sealed it.
    """

    path: str  # the staged file, relative to the root
    length: int  # the staged file's length
    rows: int
    skip: int = 0

    @property
    def size(self) -> int:
        """Bytes the piece contributes."""
        return self.length - self.skip

    def to_json(self) -> Dict[str, Any]:
        return {"path": self.path, "length": self.length, "rows": self.rows, "skip": self.skip}

    @classmethod
    def from_json(cls, raw: Any, form: int = INTENT_FORMAT) -> "Piece":
        """A piece of intent form ``form`` (1: 0.1.0's ``[path, length, rows(, skip)]``)."""
        if form == 1:
            if not isinstance(raw, list) or len(raw) not in (3, 4):
                raise TypeError(f"a staged piece is {raw!r}, not [path, length, rows(, skip)]")
            return cls(str(raw[0]), int(raw[1]), int(raw[2]), int(raw[3]) if len(raw) > 3 else 0)
        return cls(str(raw["path"]), int(raw["length"]), int(raw["rows"]), int(raw.get("skip", 0)))


@dataclass(frozen=True)
class Segment:
    """The pieces one shard file takes: appended from byte ``start_length`` (message index
    ``start_index``) on, after the batch's beginning mark if ``begin`` (the shard's first
    segment of a batch with an id), then its end mark if ``mark`` (the last segment), then
    sealed if ``seal``."""

    file: str  # the message file's name in the shard folder
    start_length: int
    start_index: int
    pieces: Tuple[Piece, ...] = ()
    seal: bool = False
    mark: bool = False
    begin: bool = False

    def to_json(self) -> Dict[str, Any]:
        out = {"file": self.file, "start_length": self.start_length, "start_index": self.start_index,
               "staged": [p.to_json() for p in self.pieces], "seal": self.seal}
        if self.begin:
            out["begin"] = True
        if self.mark:
            out["mark"] = True
        return out

    @classmethod
    def from_json(cls, raw: Any, form: int = INTENT_FORMAT) -> "Segment":
        return cls(str(raw["file"]), int(raw["start_length"]), int(raw["start_index"]),
                   tuple(Piece.from_json(p, form) for p in raw["staged"]), bool(raw["seal"]),
                   bool(raw.get("mark", False)), bool(raw.get("begin", False)))


@dataclass(frozen=True)
class Intent:
    """What a batch appends to one stream, written before its first byte: per shard, the
    segments in order, and the staging folders to delete once it is committed."""

    batch: Optional[int]
    shards: Mapping[int, Tuple[Segment, ...]] = field(default_factory=dict)
    staging_dirs: Tuple[str, ...] = ()
    #: The stream's epoch when the intent was written (None: written before epochs, epoch 0).
    epoch: Optional[int] = None

    def with_shard(self, shard: int, segments: Sequence[Segment]) -> "Intent":
        """This intent with ``shard``'s segments replaced (a redirect)."""
        return replace(self, shards={**self.shards, shard: tuple(segments)})

    def to_json(self) -> Dict[str, Any]:
        out = {"format": INTENT_FORMAT, "batch": self.batch,
               "shards": {str(s): [seg.to_json() for seg in segs] for s, segs in self.shards.items()},
               "staging_dirs": list(self.staging_dirs)}
        if self.epoch is not None:
            out["epoch"] = self.epoch
        return out

    @classmethod
    def from_json(cls, raw: Any, where: str = "sink intent") -> "Intent":
        """An intent of either form (0.1.0's has no ``format``).

        Raises
        ------
        AcsError
            The record is malformed, or of a newer form than this version reads (naming the file).
        """
        try:
            form = raw.get("format", 1)
            if form not in (1, INTENT_FORMAT):
                raise AcsError(
                    f"{where}: sink intent of format {form!r}, newer than this version of pyspark_acs reads "
                    f"(formats 1 and {INTENT_FORMAT}); complete the batch with the version that wrote it")
            batch = raw["batch"]
            shards = {int(s): tuple(Segment.from_json(seg, form) for seg in segs) for s, segs in raw["shards"].items()}
            epoch = raw.get("epoch")
            return cls(None if batch is None else int(batch), shards, tuple(str(d) for d in raw["staging_dirs"]),
                       None if epoch is None else int(epoch))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise _corrupt(where, exc) from exc


@dataclass(frozen=True)
class ShardState:
    """Where this sink left a shard: its file, length and next message index, and whether it
    sealed the file (the next batch continues an unsealed file nobody appended to since)."""

    file: str
    length: int
    next_index: int
    sealed: bool = False

    def to_json(self) -> Dict[str, Any]:
        return {"file": self.file, "length": self.length, "next_index": self.next_index, "sealed": self.sealed}

    @classmethod
    def from_json(cls, raw: Any) -> "ShardState":
        return cls(str(raw["file"]), int(raw["length"]), int(raw["next_index"]), bool(raw.get("sealed", False)))


@dataclass(frozen=True)
class SinkState:
    """A stream's sink state: the last committed batch id and where each shard was left;
    ``updated``: when it was written (seconds since the epoch); ``epoch``: the stream's epoch
    then (None: written before epochs, epoch 0). A state of another epoch than the stream's
    is from before a promotion: the sink reads its state from the marks instead."""

    last_batch: Optional[int] = None
    shards: Mapping[int, ShardState] = field(default_factory=dict)
    updated: Optional[float] = None
    epoch: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        out = {"last_batch": self.last_batch, "shards": {str(s): st.to_json() for s, st in self.shards.items()},
               "updated": self.updated}
        if self.epoch is not None:
            out["epoch"] = self.epoch
        return out

    @classmethod
    def from_json(cls, raw: Any, where: str = "sink state") -> "SinkState":
        """A state file (0.1.0 wrote the same form)."""
        try:
            last = raw.get("last_batch")
            shards = {int(s): ShardState.from_json(st) for s, st in (raw.get("shards") or {}).items()}
            updated = raw.get("updated")
            epoch = raw.get("epoch")
            return cls(None if last is None else int(last), shards, None if updated is None else float(updated),
                       None if epoch is None else int(epoch))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise _corrupt(where, exc) from exc


@dataclass(frozen=True)
class BatchManifest:
    """The streams a batch commits, in order, recorded before the first of them commits."""

    streams: Tuple[str, ...]

    def to_json(self) -> Dict[str, Any]:
        return {"streams": list(self.streams)}

    @classmethod
    def from_json(cls, raw: Any, where: str = "sink batch manifest") -> "BatchManifest":
        """A batch manifest (0.1.0 wrote the same form)."""
        try:
            streams = raw["streams"]
            if not isinstance(streams, list) or not all(isinstance(s, str) for s in streams):
                raise TypeError(f"streams is {streams!r}, not a list of stream names")
            return cls(tuple(streams))
        except (KeyError, TypeError) as exc:
            raise _corrupt(where, exc) from exc
