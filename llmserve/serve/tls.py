"""HTTPS: which certificate and key to serve with, checked before the model loads.

The files come from --ssl-certfile/--ssl-keyfile, or, with LMDeploy's --ssl, from the environment
variables SSL_CERTFILE/SSL_KEYFILE as LMDeploy reads them; a flag wins over its variable. Python's
own `ssl` loads them exactly as uvicorn will, so a file it cannot read, a file that is not PEM and
a key that is not the certificate's are refused here, each naming the file, not at the first
handshake.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass

from llmserve.errors import LLMServeError
from llmserve.serve.config import ServerConfig

CERT_ENV, KEY_ENV = "SSL_CERTFILE", "SSL_KEYFILE"


class TLSConfigError(LLMServeError):
    """A certificate or key that cannot be served with (names the file and what to change)."""


@dataclass(frozen=True)
class TLSFiles:
    certfile: str
    keyfile: str | None  # None: the key is in the certificate file


def tls_files(config: ServerConfig, environ: dict[str, str] | os._Environ[str] = os.environ) -> TLSFiles | None:
    """The checked certificate and key to serve HTTPS with; None for plain HTTP. Raises TLSConfigError."""
    certfile = config.ssl_certfile or (environ.get(CERT_ENV) if config.ssl else None)
    keyfile = config.ssl_keyfile or (environ.get(KEY_ENV) if config.ssl else None)
    if not (config.ssl or certfile or keyfile):
        return None
    if not certfile:
        raise TLSConfigError(f"HTTPS needs a certificate: give --ssl-certfile, or set {CERT_ENV} "
                             f"(and {KEY_ENV}) with --ssl")
    files = TLSFiles(certfile, keyfile or None)
    check_tls_files(files)
    return files


def check_tls_files(files: TLSFiles) -> None:
    _check_readable(files.certfile, "certificate")
    if files.keyfile is not None:
        _check_readable(files.keyfile, "key")
    try:
        ssl.create_default_context().load_verify_locations(cafile=files.certfile)
    except ssl.SSLError as e:
        raise TLSConfigError(f"certificate file {files.certfile!r} holds no PEM certificate ({e.reason or e})") from None
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(files.certfile, files.keyfile,
                                                                 password=_encrypted(files))
    except ssl.SSLError as e:
        key = files.keyfile or files.certfile
        what = ("is not the key of certificate " + repr(files.certfile) if e.reason == "KEY_VALUES_MISMATCH"
                else f"holds no PEM private key ({e.reason or e})")
        raise TLSConfigError(f"key file {key!r} {what}") from None


def _check_readable(path: str, what: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise TLSConfigError(f"{what} file {path!r} cannot be read: {e.strerror or e}") from None


def _encrypted(files: TLSFiles) -> Callable[[], str]:
    def refuse() -> str:  # without a callback, OpenSSL would prompt on the terminal
        raise TLSConfigError(f"key file {files.keyfile or files.certfile!r} is encrypted; give an unencrypted key "
                             "(e.g. `openssl pkey -in KEY -out PLAIN_KEY`)")
    return refuse
