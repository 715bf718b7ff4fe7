"""Register a gRPC servicer so that a request body that is not its protobuf message is answered
``INVALID_ARGUMENT`` naming the method, instead of the ``UNKNOWN``/``INTERNAL`` grpcio gives
when its deserializer raises (hostile bodies get the right status, docs/security.md); and so that a
handler may answer with its message already encoded (``bytes``), which goes out unserialized.

Used by the cache server (grpc.aio) and the copy daemon (threaded grpc), with the ``add_*_to_server``
function protoc generated, so the method table stays the generated one.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

__all__ = [
    "add_servicer",
]


class _Malformed:
    """What the safe deserializer returns for a body that does not parse."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


class _Capture:
    """Stands in for a server while the generated ``add_*_to_server`` registers its table."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: Dict[str, Any] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: Dict[str, Any]) -> None:
        self.service, self.handlers = service, handlers


def _pass_bytes(serialize: Optional[Callable[[Any], bytes]]) -> Optional[Callable[[Any], bytes]]:
    """``serialize``, except that a handler's answer already encoded (``bytes``: the hand-made
    byte-carrying messages of :mod:`pyspark_acs.cache.wire`) goes out as it is."""
    if serialize is None:
        return None

    def out(response: Any) -> bytes:
        return response if response.__class__ is bytes else serialize(response)

    return out


def _strict(service: str, name: str, handler: Any, aio: bool,
            decode: Optional[Callable[[bytes], Any]] = None) -> Any:
    from pyspark_acs._grpc import grpc

    handler = handler._replace(response_serializer=_pass_bytes(handler.response_serializer))

    decode = decode or handler.request_deserializer
    what = f"{service}/{name}"

    def safe(raw: bytes):
        try:
            return decode(raw)
        except Exception as exc:  # any parse failure of a hostile body
            return _Malformed(f"{what}: the request is not a valid message: {type(exc).__name__}: {exc}")

    if aio:
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                return await inner(request, context)

            return handler._replace(request_deserializer=safe, unary_unary=unary)
        if handler.stream_stream is not None:
            inner_s = handler.stream_stream

            async def checked(requests, context):
                async for request in requests:
                    if isinstance(request, _Malformed):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                    yield request

            async def stream(requests, context):
                async for reply in inner_s(checked(requests, context), context):
                    yield reply

            return handler._replace(request_deserializer=safe, stream_stream=stream)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def replies(request, context):
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                async for reply in inner_us(request, context):
                    yield reply

            return handler._replace(request_deserializer=safe, unary_stream=replies)
        return handler
    if handler.unary_unary is not None:
        inner_u = handler.unary_unary

        def unary_sync(request, context):
            if isinstance(request, _Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return inner_u(request, context)

        return handler._replace(request_deserializer=safe, unary_unary=unary_sync)
    if handler.stream_stream is not None:
        inner_ss = handler.stream_stream

        def checked_sync(requests, context):
            for request in requests:
                if isinstance(request, _Malformed):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                yield request

        def stream_sync(requests, context):
            yield from inner_ss(checked_sync(requests, context), context)

        return handler._replace(request_deserializer=safe, stream_stream=stream_sync)
    return handler


def add_servicer(add_to_server: Callable[[Any, Any], None], servicer: Any, server: Any, *, aio: bool,
                 decoders: Optional[Dict[str, Callable[[bytes], Any]]] = None) -> None:
    """``add_to_server(servicer, server)`` (the generated function), with malformed request
    bodies answered ``INVALID_ARGUMENT``. ``decoders``: method name -> what parses its request
    body instead of the generated parser (a parse error is answered the same way)."""
    from pyspark_acs._grpc import grpc

    capture = _Capture()
    add_to_server(servicer, capture)
    decoders = decoders or {}
    handlers = {name: _strict(capture.service, name, h, aio, decoders.get(name))
                for name, h in capture.handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.service, handlers),))
    server.add_registered_method_handlers(capture.service, handlers)
