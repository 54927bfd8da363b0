"""Throwaway certificates for the KV plane's mutual TLS in tests and benchmarks (the openssl CLI).

    write_certs(DIR, ["prefill", "decode"])   -> DIR/ca.crt, DIR/ca.key, DIR/<name>.crt|.key per name
    tls_config(DIR, "decode")                 -> TransportConfig keyword arguments (tls_ca/cert/key)

The same file names as the cluster's certificate directory (``ca.crt``, ``<role>.crt``, ``<role>.key``),
so a test can point a worker at one. A second call with another directory makes an unrelated CA: the
"wrong CA" peer of the security tests. EC P-256 keys, valid for two days, no host names (the KV plane
verifies the chain, not the name: kvtransfer/tls.py).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def write_certs(directory: str | Path, names: list[str], *, ca_name: str = "pdserve-test-ca") -> Path:
    """A CA and one certificate (client + server use) per name, signed by it."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _run("req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.crt", "-subj", f"/CN={ca_name}", "-days", "2",
         cwd=d)
    ext = d / "leaf.ext"
    ext.write_text("basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n"
                   "extendedKeyUsage=serverAuth,clientAuth\n")
    for name in names:
        _run("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", ext.name, cwd=d)
        (d / f"{name}.csr").unlink()
    return d


def tls_config(directory: str | Path, name: str) -> dict:
    d = Path(directory)
    return {"tls_ca": str(d / "ca.crt"), "tls_cert": str(d / f"{name}.crt"),
            "tls_key": str(d / f"{name}.key")}
