"""TLS settings: the server's one ``ssl.SSLContext`` (for the data port and the admin port), and
a client's, from what the caller gave.

The server's context is built here, once, from ``--tls-cert``, ``--tls-key`` and ``--tls-ca``;
every listener that speaks TLS wraps its connections with that same context (the data port with
``trio.SSLStream``; the admin listener the same way), so both ports present one certificate and
trust the same client CA. Nothing here opens a socket.
"""

from __future__ import annotations

import ssl

__all__ = ["TlsError", "client_context", "describe_tls_error", "server_context"]


class TlsError(ValueError):
    """A TLS setting that cannot be used: an unreadable or mismatched certificate, key or CA
    file. The message names the file and says what is wrong, in one line."""


def server_context(cert: str, key: str, ca: str | None = None) -> ssl.SSLContext:
    """The server's TLS context: its certificate chain ``cert`` (PEM) and private ``key``
    (PEM), TLS 1.2 or newer, and, with ``ca`` (a PEM file of CA certificates), client
    certificates required and checked against that CA. Raises ``TlsError``."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except FileNotFoundError as error:
        raise TlsError(f"cannot read {error.filename}: no such file") from None
    except OSError as error:  # ssl.SSLError included: not PEM, or a key that does not match
        raise TlsError(
            f"cannot use the certificate {cert} with the key {key}: {_reason(error)}"
        ) from None
    if ca is not None:
        try:
            context.load_verify_locations(cafile=ca)
        except FileNotFoundError:
            raise TlsError(f"cannot read {ca}: no such file") from None
        except OSError as error:
            raise TlsError(f"cannot use the CA file {ca}: {_reason(error)}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(tls: bool | ssl.SSLContext) -> ssl.SSLContext | None:
    """A client's TLS context from its ``tls`` argument: ``False`` none; ``True`` the system's
    trusted CAs (and ``SSL_CERT_FILE``), host names checked; an ``ssl.SSLContext`` as given
    (to trust a private CA or present a client certificate)."""
    if isinstance(tls, ssl.SSLContext):
        return tls
    if tls is True:
        return ssl.create_default_context()
    if tls is False:
        return None
    raise TypeError(f"tls must be True, False or an ssl.SSLContext, not {tls!r}")


def describe_tls_error(error: BaseException) -> str:
    """Words for a failed TLS handshake (``error`` or what caused it), for a log line or an
    exception message, with a hint when the peer seems not to speak TLS at all."""
    cause = error if isinstance(error, ssl.SSLError) else error.__cause__
    if not isinstance(cause, ssl.SSLError):
        return str(error) or type(error).__name__
    if isinstance(cause, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {cause.verify_message}"
    if isinstance(cause, ssl.SSLEOFError):
        return (
            "the peer closed the connection during the handshake (it may not trust the "
            "certificate, or not speak TLS)"
        )
    text = _reason(cause)
    if cause.reason in _NOT_TLS:
        text += " (the peer does not seem to speak TLS)"
    return text


#: OpenSSL's reasons when the first bytes are not a TLS record: a plain client on a TLS port.
_NOT_TLS = {"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNKNOWN_PROTOCOL", "PACKET_LENGTH_TOO_LONG"}


def _reason(error: OSError) -> str:
    if isinstance(error, ssl.SSLError) and error.reason:
        return error.reason.lower().replace("_", " ")
    return error.strerror or str(error)
