"""Self-signed TLS material for a local deployment (``acs up --secure``).

One CA, one certificate for the servers (valid for ``localhost``, the loopback addresses and
the bound host) and one for clients (used with mutual TLS), plus a random token in a file of
mode 0600 -- so a newcomer can try a secured deployment in one command. For deployments
across hosts use certificates of your own CA (``docs/security.md``).

Needs the ``cryptography`` package (``pip install pyspark_acs[secure]``).
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
import secrets
from pathlib import Path
from typing import Dict, Iterable, Union

from pyspark_acs.errors import AcsOptionError

__all__ = [
    "make_local_tls",
]

#: How long the generated certificates are valid (days).
CERT_VALID_DAYS = 365


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def make_local_tls(folder: Union[str, os.PathLike], hosts: Iterable[str] = ()) -> Dict[str, str]:
    """Create (or reuse) ``folder/ca.pem``, ``server.pem``/``server.key``, ``client.pem``/``client.key``
    and ``token`` (mode 0600); return their paths by name (``ca``, ``cert``, ``key``,
    ``client_cert``, ``client_key``, ``token_file``).

    Raises
    ------
    AcsOptionError
        When the ``cryptography`` package is missing (names how to install it).
    """
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError as exc:
        raise AcsOptionError("--secure needs the cryptography package: pip install 'pyspark_acs[secure]'",
                             option="--secure") from exc
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    paths = {"ca": out / "ca.pem", "cert": out / "server.pem", "key": out / "server.key",
             "client_cert": out / "client.pem", "client_key": out / "client.key", "token_file": out / "token"}
    if all(p.exists() for p in paths.values()):
        return {k: str(v) for k, v in paths.items()}
    now = _dt.datetime.now(_dt.timezone.utc)
    until = now + _dt.timedelta(days=CERT_VALID_DAYS)

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def pem_key(k) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    ca_key = key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pyspark_acs local CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    names = {"localhost", "127.0.0.1", "::1", *[h.strip("[]") for h in hosts if h]}
    sans = []
    for name in sorted(names):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))

    def leaf(common: str, server: bool):
        k = key()
        # The server certificate also allows client auth: a copy daemon is both, and with mTLS
        # processes of the deployment present it as clients.
        usage = ([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH] if server
                 else [x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH])
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)]))
                   .issuer_name(ca_name).public_key(k.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now).not_valid_after(until)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
                   .add_extension(x509.SubjectAlternativeName(sans), critical=False))
        return builder.sign(ca_key, hashes.SHA256()), k

    server, server_key = leaf("pyspark_acs server", True)
    client, client_key = leaf("pyspark_acs client", False)
    pem = serialization.Encoding.PEM
    _write(paths["ca"], ca.public_bytes(pem), 0o644)
    _write(paths["cert"], server.public_bytes(pem) + ca.public_bytes(pem), 0o644)
    _write(paths["key"], pem_key(server_key), 0o600)
    _write(paths["client_cert"], client.public_bytes(pem) + ca.public_bytes(pem), 0o644)
    _write(paths["client_key"], pem_key(client_key), 0o600)
    if not paths["token_file"].exists():
        _write(paths["token_file"], (secrets.token_urlsafe(32) + "\n").encode(), 0o600)
    return {k: str(v) for k, v in paths.items()}
