"""Checks of what the server is about to expose: the TLS files and the bind address.

grpc only says "Failed to bind" when a certificate or key is bad, naming neither file; Python's
`ssl` module parses both files the same way (OpenSSL) and tells which one is wrong, so the files
are checked with it before the server binds.
"""

from __future__ import annotations

import ipaddress
import ssl

__all__ = ["TlsFileError", "check_tls_files", "is_loopback"]


class TlsFileError(ValueError):
    """A TLS certificate or key file that cannot be used; the message names the file."""


class _Encrypted(Exception):
    pass


def _no_password():
    raise _Encrypted  # OpenSSL would otherwise prompt on the terminal


def check_tls_files(cert: str, key: str, *, cert_label: str = "tls_cert", key_label: str = "tls_key") -> None:
    """Raise `TlsFileError` ("<label>: <file> ...") unless `cert` holds a PEM certificate chain and
    `key` the unencrypted PEM private key that matches its first certificate."""
    try:
        ssl.create_default_context(cafile=cert)  # parses every certificate of the file
    except ssl.SSLError as e:  # an OSError too: first
        raise TlsFileError(f"{cert_label}: {cert!r} holds no PEM certificate ({e.reason or e})") from None
    except OSError as e:
        raise TlsFileError(f"{cert_label}: cannot read {cert!r}: {e.strerror or e}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=_no_password)
    except _Encrypted:
        raise TlsFileError(f"{key_label}: {key!r} is encrypted; the server needs an unencrypted PEM key") from None
    except OSError as e:
        if isinstance(e, ssl.SSLError) and e.reason == "KEY_VALUES_MISMATCH":
            raise TlsFileError(f"{key_label}: the key in {key!r} does not match the certificate in {cert!r}") from None
        if isinstance(e, ssl.SSLError):
            raise TlsFileError(f"{key_label}: {key!r} holds no PEM private key") from None
        raise TlsFileError(f"{key_label}: cannot read {key!r}: {e.strerror or e}") from None


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1); anything else, including
    0.0.0.0, :: and other host names, may be reachable from other machines."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
