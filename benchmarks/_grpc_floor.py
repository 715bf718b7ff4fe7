"""The grpcio floor: what the same grpcio, in Python, costs for the cache path's two shapes when
the server does nothing else (a peer for ``cache_throughput.py`` and ``fanout.py``).

The cache servers are grpcio servers (docs/overview.md section 4), and the benchmarks compare
them with redis-server, a C program. This server is the least a Python grpc.aio server can do for the
same traffic, with the cache server's allocator settings and message limits:

- ``Get``: a unary call answered with a pre-built run of bytes (``--get-bytes``, default 1 MiB,
  one batched read of 256 chunks), raw bytes both ways: no store, no protobuf, no metrics, no
  token;
- ``Publish`` / ``Follow``: a one-server relay. The producer sends each flush's bytes as one
  message on a ``Publish`` stream and gets one acknowledgement per message (as our PutStream
  and a Redis pipeline do); each follower opens one ``Follow`` stream (answered first with an
  empty message: subscribed) and is pushed every flush's bytes as one message (as our data replicas push a followed file's chunks). No
  replication, no lengths, no durable store. ``fanout.py``'s ``grpc3`` column runs six of them in
  the shape of a 3 data + 3 metadata deployment (each flush to three, then a length to three;
  each follower on one of the three).

Run as a process: ``python benchmarks/_grpc_floor.py`` prints ``port N`` and serves until
killed. :class:`FloorServer` starts and stops one; :func:`get_call`, :func:`follow` and
:func:`publisher` are the client side, plain grpcio with raw-bytes (de)serializers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyspark_acs._grpc import grpc  # noqa: E402  (fork handlers off, as in the package)
# The cache protocol's message limit, so both ends accept the same sizes as the cache's.
from pyspark_acs.cache.wire import CACHE_MAX_MESSAGE_BYTES  # noqa: E402

SERVICE = "acsbench.Floor"
OPTIONS = [("grpc.max_send_message_length", CACHE_MAX_MESSAGE_BYTES),
           ("grpc.max_receive_message_length", CACHE_MAX_MESSAGE_BYTES)]
DEFAULT_GET_BYTES = 1 << 20
START_TIMEOUT_S = 30.0


async def _serve(get_bytes: int) -> None:
    answer = os.urandom(get_bytes)
    flushes: List[bytes] = []  # every published message, in order (a run is tens of MB)
    changed = [asyncio.Event()]  # replaced on each publish: followers wait on the current one

    async def get(request: bytes, context) -> bytes:
        return answer

    async def publish(requests, context):
        async for message in requests:
            flushes.append(message)
            event, changed[0] = changed[0], asyncio.Event()
            event.set()
            yield b"ok"

    async def follow(request: bytes, context):
        i = int(request) if request else len(flushes)  # b"": from the next published message
        await context.write(b"")  # subscribed: the follower may say it is ready
        while True:
            while i < len(flushes):
                await context.write(flushes[i])
                i += 1
            await changed[0].wait()

    handlers = {
        "Get": grpc.unary_unary_rpc_method_handler(get),
        "Publish": grpc.stream_stream_rpc_method_handler(publish),
        "Follow": grpc.unary_stream_rpc_method_handler(follow),
    }
    server = grpc.aio.server(options=OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"port {port}", flush=True)
    await server.wait_for_termination()


class FloorServer:
    """One floor server process on a free loopback port."""

    def __init__(self, get_bytes: int = DEFAULT_GET_BYTES) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--get-bytes", str(get_bytes)],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline().split()
        if len(line) != 2 or line[0] != "port":
            self.stop()
            raise RuntimeError(f"the grpc floor server did not start: {line!r}")
        self.port = int(line[1])
        self.endpoint = f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def channel(endpoint: str) -> "grpc.Channel":
    return grpc.insecure_channel(endpoint, options=OPTIONS)


def get_call(ch: "grpc.Channel") -> Callable[[bytes], bytes]:
    """The unary ``Get``: request bytes in (ignored by the server), the pre-built answer out."""
    return ch.unary_unary(f"/{SERVICE}/Get")


def follow(ch: "grpc.Channel") -> Iterator[bytes]:
    """Every message published from now on, as pushed (the server keeps earlier runs' too).
    Returns once the server took the subscription."""
    stream = ch.unary_stream(f"/{SERVICE}/Follow")(b"")
    next(stream)  # the empty first message
    return stream


class Publisher:
    """One ``Publish`` stream: :meth:`send` queues a message, :meth:`ack` waits for the next
    acknowledgement (in order); :meth:`__call__` does both. One thread at a time."""

    def __init__(self, ch: "grpc.Channel") -> None:
        self._outbox: "queue.SimpleQueue" = queue.SimpleQueue()
        self._acks = ch.stream_stream(f"/{SERVICE}/Publish")(iter(self._outbox.get, None))

    def send(self, message: bytes) -> None:
        self._outbox.put(message)

    def ack(self) -> None:
        next(self._acks)

    def __call__(self, message: bytes) -> None:
        self.send(message)
        self.ack()


def publisher(ch: "grpc.Channel") -> Publisher:
    """A :class:`Publisher`: called with a message, returns once the server acknowledged it."""
    return Publisher(ch)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--get-bytes", type=int, default=DEFAULT_GET_BYTES, help="size of Get's answer")
    args = p.parse_args()
    from pyspark_acs.server.malloc import tune_malloc

    tune_malloc()  # the cache server's allocator settings (acs-cache-server does the same)
    asyncio.run(_serve(args.get_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
