"""One place for the security settings of every endpoint (cache servers, copy daemons, metrics).

A deployment has one shared **token** (every gRPC call carries ``authorization: Bearer
<token>``; servers compare it in constant time) and optionally **TLS** (grpcio's own
credentials: a server certificate and key, a CA bundle clients verify servers with, and with
mutual TLS clients present the same kind of certificate). See ``docs/security.md``.

Where a setting comes from -- the explicit argument wins, else the environment:

=====================  ===========================================================
variable               meaning
=====================  ===========================================================
``ACS_CACHE_TOKEN``    the token itself (kept for existing deployments)
``ACS_TOKEN_FILE``     a file holding the token (first line; preferred: a value in
                       the environment of a process is readable by its owner only,
                       a file can be mode 0600; never a command-line value, which
                       ``ps`` shows to every user)
``ACS_TLS_CERT``       PEM certificate chain of this process (servers; clients with mTLS)
``ACS_TLS_KEY``        PEM private key of that certificate
``ACS_TLS_CA``         PEM CA bundle: clients verify servers with it; with mTLS,
                       servers verify clients with it
``ACS_TLS_MTLS``       ``1``/``true``: servers require client certificates
=====================  ===========================================================

:class:`SecuritySettings` is plain picklable data (paths and the token, never open files
or credentials objects), so it crosses into Spark tasks and the topology file unchanged. There
is no process-wide default besides the environment: whatever builds clients for settings it
was given (the Spark source and sink options, a copy daemon) passes them to each client.
"""

from __future__ import annotations

import collections
import functools
import hmac
import ipaddress
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence, Tuple

from pyspark_acs.errors import AcsOptionError

__all__ = [
    "ENV_MTLS",
    "ENV_TLS_CA",
    "ENV_TLS_CERT",
    "ENV_TLS_KEY",
    "ENV_TOKEN",
    "ENV_TOKEN_FILE",
    "SecuritySettings",
    "TokenInterceptor",
    "check_bind",
    "metadata_has_token",
    "resolve_security",
    "token_matches",
]

ENV_TOKEN = "ACS_CACHE_TOKEN"
ENV_TOKEN_FILE = "ACS_TOKEN_FILE"
ENV_TLS_CERT = "ACS_TLS_CERT"
ENV_TLS_KEY = "ACS_TLS_KEY"
ENV_TLS_CA = "ACS_TLS_CA"
ENV_MTLS = "ACS_TLS_MTLS"
#: A token file larger than this is not a token file (bytes).
MAX_TOKEN_FILE_BYTES = 4096
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def read_token_file(path: str, *, option: str = ENV_TOKEN_FILE) -> str:
    """The token in ``path`` (its first line, stripped).

    Raises
    ------
    AcsOptionError
        When the file cannot be read, is too large or holds no token; names ``option`` and the file.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as exc:
        raise AcsOptionError(f"{option}: cannot read the token file {path}: {exc.strerror or exc}",
                             option=option) from exc
    if len(raw) > MAX_TOKEN_FILE_BYTES:
        raise AcsOptionError(f"{option}: {path} is over {MAX_TOKEN_FILE_BYTES} bytes; not a token file",
                             option=option)
    lines = raw.decode("utf-8", "replace").strip().splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise AcsOptionError(f"{option}: the token file {path} is empty", option=option)
    return token


def _read_pem(path: Optional[str], option: str) -> Optional[bytes]:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise AcsOptionError(f"{option}: cannot read {path}: {exc.strerror or exc}", option=option) from exc


def token_matches(given: Any, token: str) -> bool:
    """Whether ``given`` (an ``authorization`` value: ``Bearer <token>`` or the bare token) is
    ``token``; constant-time."""
    if not token or given is None:
        return False
    raw = given.encode() if isinstance(given, str) else bytes(given)
    return hmac.compare_digest(raw, f"Bearer {token}".encode()) | hmac.compare_digest(raw, token.encode())


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` reaches this machine only (``localhost``, 127/8, ::1)."""
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class SecuritySettings:
    """The token and TLS files of one process; plain picklable data.

    Parameters
    ----------
    token : str, optional
        Shared token every call carries and every server requires. ``None``: no token.
    tls_cert, tls_key : str, optional
        Paths of this process's PEM certificate chain and private key (servers; with
        ``mtls`` also clients).
    tls_ca : str, optional
        Path of the PEM CA bundle: clients verify servers against it (TLS is on for clients
        when it is set); with ``mtls`` servers verify clients against it.
    mtls : bool
        Servers require and verify client certificates.
    """

    token: Optional[str] = None
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    tls_ca: Optional[str] = None
    mtls: bool = False

    def __repr__(self) -> str:  # never print the token
        return (f"SecuritySettings(token={'***' if self.token else None}, tls_cert={self.tls_cert!r}, "
                f"tls_key={self.tls_key!r}, tls_ca={self.tls_ca!r}, mtls={self.mtls})")

    @property
    def server_tls(self) -> bool:
        """Servers listen with TLS (a certificate and key are set)."""
        return bool(self.tls_cert and self.tls_key)

    @property
    def client_tls(self) -> bool:
        """Clients connect with TLS (a CA bundle is set)."""
        return bool(self.tls_ca)

    def with_token(self, token: Optional[str]) -> "SecuritySettings":
        """These settings with ``token`` instead (``None`` keeps this one)."""
        return self if token is None else replace(self, token=token)

    def call_metadata(self) -> Optional[Tuple[Tuple[str, str], ...]]:
        """The gRPC metadata every call carries (``None`` without a token)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else None

    def http_headers(self) -> dict:
        """HTTP headers for ``/metrics`` and ``/healthz`` of token-protected servers."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    # -- gRPC ---------------------------------------------------------------------------------

    def channel(self, address: str, options: Sequence[Tuple[str, Any]] = (), *, with_token: bool = False):
        """A gRPC channel to ``address``: TLS when a CA bundle is set, else plaintext; with
        ``with_token`` every call on it carries the token (callers that pass
        :meth:`call_metadata` themselves leave it off)."""
        from pyspark_acs._fork import open_grpc
        from pyspark_acs._grpc import grpc

        if not self.client_tls:
            channel = open_grpc(f"gRPC channel to {address}",
                                lambda: grpc.insecure_channel(address, options=list(options)))
        else:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read_pem(self.tls_ca, ENV_TLS_CA),
                private_key=_read_pem(self.tls_key, ENV_TLS_KEY) if self.mtls else None,
                certificate_chain=_read_pem(self.tls_cert, ENV_TLS_CERT) if self.mtls else None,
            )
            channel = open_grpc(f"gRPC channel to {address}",
                                lambda: grpc.secure_channel(address, creds, options=list(options)))
        if with_token and self.token:
            channel = grpc.intercept_channel(channel, _grpc_classes()[0](self.call_metadata()))
        return channel

    def server_credentials(self):
        """grpcio server credentials (``None`` without a certificate: plaintext)."""
        from pyspark_acs._grpc import grpc

        if not self.server_tls:
            return None
        return grpc.ssl_server_credentials(
            [(_read_pem(self.tls_key, ENV_TLS_KEY), _read_pem(self.tls_cert, ENV_TLS_CERT))],
            root_certificates=_read_pem(self.tls_ca, ENV_TLS_CA) if self.mtls else None,
            require_client_auth=self.mtls,
        )

    def add_port(self, server: Any, address: str) -> int:
        """Bind ``server`` (grpc or grpc.aio) to ``address`` with TLS when configured; the port."""
        creds = self.server_credentials()
        if creds is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, creds)

    def ssl_context(self):
        """An ``ssl.SSLContext`` for HTTP servers (``None`` without a certificate)."""
        if not self.server_tls:
            return None
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.tls_cert, self.tls_key)
        if self.mtls and self.tls_ca:
            ctx.load_verify_locations(self.tls_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def to_env(self) -> dict:
        """These settings as environment variables (for child processes; the token as a file
        is preferred: see :func:`resolve_security`)."""
        env = {}
        if self.token:
            env[ENV_TOKEN] = self.token
        for name, value in ((ENV_TLS_CERT, self.tls_cert), (ENV_TLS_KEY, self.tls_key), (ENV_TLS_CA, self.tls_ca)):
            if value:
                env[name] = value
        if self.mtls:
            env[ENV_MTLS] = "1"
        return env


def _flag(value: Any, option: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise AcsOptionError(f"{option}: {value!r} is not a boolean (use 1/0, true/false)", option=option)


def resolve_security(
    *,
    token: Optional[str] = None,
    token_file: Optional[str] = None,
    tls_cert: Optional[str] = None,
    tls_key: Optional[str] = None,
    tls_ca: Optional[str] = None,
    mtls: Optional[bool] = None,
    env: Optional[Mapping[str, str]] = None,
) -> SecuritySettings:
    """The settings of this process: each explicit argument wins, else its environment variable.

    The token: ``token``, else the file ``token_file``, else ``$ACS_CACHE_TOKEN``, else the
    file ``$ACS_TOKEN_FILE``, else none.

    Raises
    ------
    AcsOptionError
        For an unreadable or empty token file, an empty token, a certificate without its key
        (or the reverse), or mutual TLS without a CA bundle; names the setting.
    """
    env = os.environ if env is None else env
    if token is not None and not str(token).strip():
        raise AcsOptionError("token: must not be empty", option="token")
    if token is None and token_file:
        token = read_token_file(token_file, option="token_file")
    if token is None:
        token = env.get(ENV_TOKEN) or None
    if token is None and env.get(ENV_TOKEN_FILE):
        token = read_token_file(env[ENV_TOKEN_FILE])
    cert = tls_cert or env.get(ENV_TLS_CERT) or None
    key = tls_key or env.get(ENV_TLS_KEY) or None
    ca = tls_ca or env.get(ENV_TLS_CA) or None
    mutual = mtls if mtls is not None else _flag(env.get(ENV_MTLS, ""), ENV_MTLS)
    if bool(cert) != bool(key):
        raise AcsOptionError(
            f"tls_cert/tls_key ({ENV_TLS_CERT}/{ENV_TLS_KEY}): a certificate needs its key and the reverse",
            option="tls_cert")
    if mutual and not (ca and cert):
        raise AcsOptionError(
            f"mtls ({ENV_MTLS}): mutual TLS needs a CA bundle ({ENV_TLS_CA}) and a certificate ({ENV_TLS_CERT})",
            option="mtls")
    return SecuritySettings(token=token.strip() if token else None, tls_cert=cert, tls_key=key, tls_ca=ca,
                            mtls=mutual)


def check_bind(host: str, settings: SecuritySettings, insecure: bool, *, what: str) -> None:
    """Refuse to bind a non-loopback ``host`` without TLS and a token unless ``insecure``.

    Raises
    ------
    AcsOptionError
        Naming ``what``, the host, what is missing, and ``--insecure``.
    """
    if insecure or is_loopback(host):
        return
    missing = [n for n, ok in (("a token (ACS_TOKEN_FILE)", settings.token),
                               ("TLS (ACS_TLS_CERT/ACS_TLS_KEY)", settings.server_tls)) if not ok]
    if missing:
        raise AcsOptionError(
            f"{what}: refusing to bind {host} (reachable from other machines) without {' and '.join(missing)}; "
            f"set them, or pass --insecure to accept the risk", option="--host")


@functools.lru_cache(maxsize=None)
def _grpc_classes():
    """The gRPC interceptor classes, built on first use (importing pyspark_acs must not import grpc)."""
    from pyspark_acs._grpc import grpc

    class CallDetails(
        collections.namedtuple("CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                               "compression")),
        grpc.ClientCallDetails,
    ):
        pass

    class AddToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
        """Adds the token to every call of a channel."""

        def __init__(self, metadata: Tuple[Tuple[str, str], ...]) -> None:
            self._metadata = metadata

        def _details(self, d: Any) -> CallDetails:
            metadata = tuple(d.metadata or ()) + self._metadata
            return CallDetails(d.method, d.timeout, metadata, d.credentials, getattr(d, "wait_for_ready", None),
                               getattr(d, "compression", None))

        def intercept_unary_unary(self, continuation, client_call_details, request):
            return continuation(self._details(client_call_details), request)

        def intercept_unary_stream(self, continuation, client_call_details, request):
            return continuation(self._details(client_call_details), request)

        def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
            return continuation(self._details(client_call_details), request_iterator)

        def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
            return continuation(self._details(client_call_details), request_iterator)

    class TokenCheck(grpc.ServerInterceptor):
        """Refuses every call without the token (``UNAUTHENTICATED``), streaming calls included."""

        def __init__(self, token: str, stream_methods: Iterable[str], unary_stream_methods: Iterable[str]) -> None:
            self._token = token
            self._streams = frozenset(stream_methods)
            self._unary_streams = frozenset(unary_stream_methods)

            def deny(request, context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED_MESSAGE)

            self._deny = grpc.unary_unary_rpc_method_handler(deny)
            self._deny_stream = grpc.stream_stream_rpc_method_handler(deny)
            self._deny_unary_stream = grpc.unary_stream_rpc_method_handler(deny)

        def intercept_service(self, continuation: Callable, handler_call_details: Any):
            if metadata_has_token(handler_call_details.invocation_metadata, self._token):
                return continuation(handler_call_details)
            method = handler_call_details.method.rsplit("/", 1)[-1]
            if method in self._streams:
                return self._deny_stream
            if method in self._unary_streams:
                return self._deny_unary_stream
            return self._deny

    return AddToken, TokenCheck


#: What a call without the right token is told (never which part was wrong).
DENIED_MESSAGE = "missing or wrong token"


def metadata_has_token(metadata: Any, token: str) -> bool:
    """Whether gRPC invocation metadata carries ``authorization`` equal to ``token`` (constant-time)."""
    ok = False
    for key, value in metadata or ():
        if key == "authorization":
            ok = token_matches(value, token) or ok
    return ok


def TokenInterceptor(token: str, stream_methods: Iterable[str] = (), unary_stream_methods: Iterable[str] = ()):  # noqa: N802
    """A synchronous gRPC server interceptor refusing every call without ``token``
    (``UNAUTHENTICATED``); ``stream_methods`` / ``unary_stream_methods`` name the methods
    that are bidirectional / server streams (denied with a handler of their kind)."""
    return _grpc_classes()[1](token, stream_methods, unary_stream_methods)
