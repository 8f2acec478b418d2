"""Telling a TLS failure apart from an unreachable Redis: a certificate the other side refuses
is a configuration error, not an outage, so nothing should wait it out."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH.
NAME_MISMATCH_CODES = (62, 64)


@dataclass(frozen=True, slots=True)
class TlsFailure:
    """Why the TLS handshake with Redis failed, and what to check."""

    reason: str
    hint: str

    def message(self, redacted_url: str) -> str:
        """One line for an operator, e.g. for a wrong CA: `TLS to Redis at rediss://... failed:
        certificate verify failed: ... (check --redis-url's ssl_ca_certs: ...)`."""
        return f"TLS to Redis at {redacted_url} failed: {self.reason} ({self.hint})"


def tls_failure(exc: BaseException) -> TlsFailure | None:
    """The certificate failure behind a redis-py connection error (redis-py raises
    ConnectionError with the ssl error as its context), or None for anything else (a TLS
    connection cut by a restarting server is an outage, not this)."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ssl.SSLCertVerificationError):
            return _verify_failure(error)
        if isinstance(error, ssl.SSLError) and "CERTIFICATE" in (error.reason or ""):
            # An alert from the server: it wants a client certificate, or refused ours.
            return TlsFailure(
                error.reason.lower().replace("_", " "),
                "the server checks client certificates: --redis-url's ssl_certfile and "
                "ssl_keyfile, signed by a CA the server trusts",
            )
        error = error.__cause__ or error.__context__
    return None


def _verify_failure(error: ssl.SSLCertVerificationError) -> TlsFailure:
    reason = f"certificate verify failed: {str(error.verify_message).rstrip('.')}"
    if error.verify_code in NAME_MISMATCH_CODES:
        return TlsFailure(reason, "the server's certificate does not name the host of the URL")
    return TlsFailure(
        reason, "check --redis-url's ssl_ca_certs: the CA that signed the server's certificate"
    )
