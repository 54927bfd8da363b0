"""The cluster's certificate authority and one certificate per component, for ``--tls-dir``.

``init_certs(DIR)`` writes (pdserve/tls.py reads them; the KV plane too)::

    ca.crt ca.key                  a self-signed CA (ECDSA P-256); keep ca.key offline once done
    <name>.crt <name>.key          for router, prefill, decode, colocated, client: signed by the CA,
                                   usable as server and client (mutual TLS), subjectAltName = the
                                   name itself (what callers verify), localhost, 127.0.0.1, ::1 and
                                   every ``hosts`` entry (DNS names or IPs clients dial the router at)

Keys are written 0600. An existing directory is refused unless ``force``: replacing a CA cuts every
running peer off. In Kubernetes, cert-manager issues the same names from a CA Issuer
(deploy/helm/pdserve, docs/security.md).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.tls import CA_FILE, IDENTITIES

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _san(entries: Sequence[str]) -> x509.SubjectAlternativeName:
    out: list[x509.GeneralName] = []
    for e in dict.fromkeys(entries):  # ordered, unique
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(e)))
        except ValueError:
            out.append(x509.DNSName(e))
    return x509.SubjectAlternativeName(out)


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def init_certs(directory: str | Path, *, names: Sequence[str] = IDENTITIES, hosts: Sequence[str] = (),
               days: int = 365, force: bool = False) -> list[Path]:
    """Write the CA and one certificate per name; the paths written."""
    if days < 1:
        raise ValueError(f"--days must be >= 1, got {days}")
    d = Path(directory)
    if (d / CA_FILE).exists() and not force:
        raise FileExistsError(f"{d / CA_FILE} exists; --force replaces the CA (every peer must then get the "
                              f"new files)")
    d.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"pdserve cluster CA {os.urandom(4).hex()}")  # two clusters' CAs never share a name
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, encipher_only=False,
                                       decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    written = [d / CA_FILE, d / "ca.key"]
    _write(written[0], ca.public_bytes(serialization.Encoding.PEM), private=False)
    _write(written[1], _key_pem(ca_key), private=True)
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca_name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(_san([name, *DEFAULT_HOSTS, *hosts]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write(d / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM), private=False)
        _write(d / f"{name}.key", _key_pem(key), private=True)
        written += [d / f"{name}.crt", d / f"{name}.key"]
    return written
