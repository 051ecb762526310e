"""The admission webhook's served TLS certificate: fetched with the standard library, its expiry
read from the DER with a small bounded ASN.1 walk (no `cryptography` at run time), and whether the
ValidatingWebhookConfiguration's caBundle trusts it.
"""

from __future__ import annotations

import base64
import datetime
import socket
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_CERT_BYTES = 64 * 1024


class CertificateError(Exception):
    """The bytes are not an X.509 certificate this reader understands."""


@dataclass
class ServedCertificate:
    not_after: datetime.datetime
    trusted: bool | None  # None: no caBundle to check against
    trust_error: str = ""


def _tlv(der: bytes, i: int) -> tuple[int, int, int]:
    """(tag, start of contents, end of contents) of the DER element at `i`."""
    if i + 2 > len(der):
        raise CertificateError("truncated DER")
    tag, first = der[i], der[i + 1]
    i += 2
    if first < 0x80:
        length = first
    else:
        n = first & 0x7F
        if n == 0 or n > 4 or i + n > len(der):
            raise CertificateError("bad DER length")
        length = int.from_bytes(der[i : i + n], "big")
        i += n
    if i + length > len(der):
        raise CertificateError("DER element longer than the certificate")
    return tag, i, i + length


def _time(tag: int, text: str) -> datetime.datetime:
    if tag == 0x17:  # UTCTime YYMMDDHHMMSSZ: years 50-99 are 19xx (RFC 5280)
        year = int(text[:2])
        text = ("19" if year >= 50 else "20") + text
    elif tag != 0x18:  # GeneralizedTime YYYYMMDDHHMMSSZ
        raise CertificateError(f"unexpected time tag 0x{tag:02x}")
    try:
        return datetime.datetime.strptime(text, "%Y%m%d%H%M%SZ").replace(tzinfo=datetime.UTC)
    except ValueError as exc:
        raise CertificateError(f"bad certificate time {text!r}") from exc


def not_after(der: bytes) -> datetime.datetime:
    """tbsCertificate.validity.notAfter of a DER X.509 certificate."""
    if len(der) > MAX_CERT_BYTES:
        raise CertificateError("certificate larger than 64 KiB")
    tag, start, _ = _tlv(der, 0)  # Certificate SEQUENCE
    tag2, i, tbs_end = _tlv(der, start)  # tbsCertificate SEQUENCE
    if tag != 0x30 or tag2 != 0x30:
        raise CertificateError("not an X.509 certificate")
    tag, _, end = _tlv(der, i)
    if tag == 0xA0:  # [0] EXPLICIT version
        i = end
    for _ in range(3):  # serialNumber, signature AlgorithmIdentifier, issuer Name
        _, _, i = _tlv(der, i)
    tag, v_start, _ = _tlv(der, i)  # validity SEQUENCE { notBefore, notAfter }
    if tag != 0x30 or i >= tbs_end:
        raise CertificateError("no validity in the certificate")
    _, _, after_nb = _tlv(der, v_start)
    tag, t_start, t_end = _tlv(der, after_nb)
    return _time(tag, der[t_start:t_end].decode("ascii", errors="replace"))


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise ValueError(f"{url!r} is not an https:// URL")
    return parts.hostname, parts.port or 443


def fetch(url: str, ca_bundle_b64: str | None, timeout: float) -> ServedCertificate:
    """The certificate the webhook serves (not verified: an expired one is still read), then a
    verified handshake with the caBundle the apiserver uses."""
    host, port = host_port(url)
    unverified = ssl.create_default_context()
    unverified.check_hostname = False
    unverified.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection((host, port), timeout=timeout) as sock,
        unverified.wrap_socket(sock, server_hostname=host) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    if not der:
        raise CertificateError("the server sent no certificate")
    served = ServedCertificate(not_after=not_after(der), trusted=None)
    if ca_bundle_b64:
        try:
            ca_pem = base64.b64decode(ca_bundle_b64).decode("ascii")
            verified = ssl.create_default_context(cadata=ca_pem)
            verified.check_hostname = False  # the apiserver checks the name; here only the chain
            with (
                socket.create_connection((host, port), timeout=timeout) as sock,
                verified.wrap_socket(sock, server_hostname=host),
            ):
                served.trusted = True
        except (ssl.SSLError, ValueError, UnicodeDecodeError) as exc:
            served.trusted = False
            served.trust_error = getattr(exc, "verify_message", None) or str(exc)
    return served
