"""HTTPS (issue 24 §6): `llmserve serve` with a self-signed certificate, given by flags or (LMDeploy's --ssl) by
SSL_CERTFILE/SSL_KEYFILE, answers the official openai client over TLS and refuses plain HTTP; a certificate or key
that cannot be used stops start-up with an error naming the file, before the model loads."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from llmserve.cli import main
from llmserve.serve.config import ServerConfig
from llmserve.serve.tls import TLSConfigError, TLSFiles, tls_files
from tests.server.harness import wait_until

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402


def _write_pair(directory: Path, name: str) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return _write_pair(tmp_path_factory.mktemp("tls"), "server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _serving(model_dir: str, log_path: Path, flags: list[str], env: dict[str, str]) -> Iterator[int]:
    port = _free_port()
    cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--model", model_dir, "--server-port", str(port),
           "--model-name", "tiny", "--dtype", "float32", "--num-blocks", "64", "--cache-block-seq-len", "16",
           "--shutdown-timeout", "0", *flags]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        assert proc.returncode == 0, log_path.read_text()


def _check_https(port: int, cert: str, log_path: Path) -> None:
    url = f"https://127.0.0.1:{port}"
    with httpx.Client(verify=ssl.create_default_context(cafile=cert), timeout=60) as http:
        def healthy() -> bool:
            try:
                return http.get(url + "/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, timeout=120, what="the HTTPS server to be ready")
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", http_client=http)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
    with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port: no answer
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
    with pytest.raises(httpx.ConnectError):  # a client that does not trust the self-signed certificate
        httpx.get(url + "/health", timeout=10)
    assert f"listening on https://127.0.0.1:{port}" in log_path.read_text()


def test_https_with_certificate_flags(tiny_model_dir: Callable[[str], str], pair: tuple[str, str],
                                      tmp_path: Path) -> None:
    cert, key = pair
    log = tmp_path / "serve.log"
    # The variables name files that do not exist: the flags win.
    with _serving(tiny_model_dir("llama"), log, ["--ssl-certfile", cert, "--ssl-keyfile", key],
                  {"SSL_CERTFILE": "/nonexistent.crt", "SSL_KEYFILE": "/nonexistent.key"}) as port:
        _check_https(port, cert, log)


def test_https_with_lmdeploy_ssl_flag_and_environment(tiny_model_dir: Callable[[str], str], pair: tuple[str, str],
                                                      tmp_path: Path) -> None:
    cert, key = pair
    log = tmp_path / "serve.log"
    with _serving(tiny_model_dir("llama"), log, ["--ssl"], {"SSL_CERTFILE": cert, "SSL_KEYFILE": key}) as port:
        _check_https(port, cert, log)


def test_tls_files_resolution(pair: tuple[str, str]) -> None:
    cert, key = pair
    env = {"SSL_CERTFILE": cert, "SSL_KEYFILE": key}
    assert tls_files(ServerConfig(), env) is None  # the variables alone do not turn HTTPS on (as LMDeploy)
    assert tls_files(ServerConfig(ssl=True), env) == TLSFiles(cert, key)
    assert tls_files(ServerConfig(ssl_certfile=cert, ssl_keyfile=key), {}) == TLSFiles(cert, key)
    with pytest.raises(TLSConfigError, match="HTTPS needs a certificate: give --ssl-certfile, or set SSL_CERTFILE"):
        tls_files(ServerConfig(ssl=True), {})


def _bad_files(tmp_path: Path, pair: tuple[str, str]) -> list[tuple[list[str], str]]:
    cert, key = pair
    other_cert, other_key = _write_pair(tmp_path, "other")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    unreadable = tmp_path / "unreadable.key"
    unreadable.write_bytes(Path(key).read_bytes())
    unreadable.chmod(0)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(serialization.load_pem_private_key(Path(key).read_bytes(), None).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")))
    cases = [
        (["--ssl-certfile", str(tmp_path / "missing.crt"), "--ssl-keyfile", key],
         f"certificate file '{tmp_path / 'missing.crt'}' cannot be read: No such file or directory"),
        (["--ssl-certfile", str(garbage), "--ssl-keyfile", key],
         f"certificate file '{garbage}' holds no PEM certificate"),
        (["--ssl-certfile", cert, "--ssl-keyfile", str(garbage)], f"key file '{garbage}' holds no PEM private key"),
        (["--ssl-certfile", cert, "--ssl-keyfile", other_key],
         f"key file '{other_key}' is not the key of certificate '{cert}'"),
        (["--ssl-certfile", other_cert], f"key file '{other_cert}' holds no PEM private key"),  # no key given
        (["--ssl-keyfile", key], "HTTPS needs a certificate"),
        (["--ssl-certfile", cert, "--ssl-keyfile", str(encrypted)], f"key file '{encrypted}' is encrypted"),
    ]
    if os.geteuid() != 0:  # root reads any file
        cases.append((["--ssl-certfile", cert, "--ssl-keyfile", str(unreadable)],
                      f"key file '{unreadable}' cannot be read: Permission denied"))
    return cases


def test_unusable_certificate_or_key_is_a_startup_error(pair: tuple[str, str], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # The model does not exist: the TLS check must come first (the model would fail later, after listening).
    for flags, message in _bad_files(tmp_path, pair):
        assert main(["serve", "--model", str(tmp_path / "no-model"), "--server-port", "0", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert f"llmserve: error: {message}" in err, (flags, err)
