"""TLS: launch / `nbserve serve` with a certificate and key file serve https:// (links, /health
poll, openai_client); a missing, unreadable or mismatched file is a clear error before the server
starts. The certificates are self-signed, made here with `cryptography`."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from nbserve.serving.launch import launch, running_servers

ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "Say something."}]


def make_tls_files(folder: Path, name: str = "server", password: bytes | None = None
                   ) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1, and its key (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nbserve test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         crl_sign=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    encryption = (serialization.BestAvailableEncryption(password) if password
                  else serialization.NoEncryption())
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8, encryption))
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


pytestmark = pytest.mark.usefixtures("no_server_left")


def trusting(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


@contextlib.contextmanager
def _records(logger: str) -> Iterator[list[logging.LogRecord]]:
    """The records `logger` emits in the block (uvicorn's loggers do not reach caplog)."""
    got: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = got.append  # type: ignore[method-assign]
    logging.getLogger(logger).addHandler(handler)
    try:
        yield got
    finally:
        logging.getLogger(logger).removeHandler(handler)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launch_with_a_certificate_serves_https(tiny_llama_dir, tls_files, capsys):
    cert, key = tls_files
    srv = launch(str(tiny_llama_dir), max_batch=2, ui=False, ssl_certfile=str(cert),
                 ssl_keyfile=key)
    try:
        assert srv.url == f"https://127.0.0.1:{srv.port}" and srv.api_base == srv.url + "/v1"
        printed = capsys.readouterr().out
        assert f"at {srv.url} · OpenAI API base {srv.api_base}" in printed
        assert "http://" not in printed
        assert httpx.get(srv.url + "/health", verify=trusting(cert)).json()["ready"]
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(srv.url + "/health")  # a real certificate check: ours is not trusted
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=5)  # no plain HTTP

        client = openai.OpenAI(base_url=srv.api_base, api_key="unused", max_retries=0,
                               http_client=httpx.Client(verify=trusting(cert)))
        out = client.chat.completions.create(model=srv.engine.model_name, messages=CHAT,
                                             max_tokens=3)
        assert out.choices[0].message.content is not None
        # srv.openai_client() trusts the server's own certificate (and the system's CAs)
        out = srv.openai_client(max_retries=0).chat.completions.create(
            model=srv.engine.model_name, messages=CHAT, max_tokens=3, stream=True)
        assert any(chunk.choices for chunk in out)
        assert f'href="{srv.url}"' in srv._repr_html_()
        # The clients keep their connections open: a TLS close waits for the client's answer,
        # which an idle client never sends; stop() must not wait out uvicorn's grace for them.
        with _records("uvicorn.error") as records:
            srv.stop()
        assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []
    finally:
        srv.stop()


def test_stop_over_tls_ends_a_running_stream_with_its_final_chunk(tiny_llama_dir, tls_files):
    from test_launch import rambling, wait_for

    cert, key = tls_files
    srv = launch(rambling(tiny_llama_dir, delay=0.02), max_batch=2, ui=False,
                 ssl_certfile=cert, ssl_keyfile=key)
    chunks: list = []
    errors: list = []

    def consume() -> None:
        try:
            chunks.extend(srv.openai_client(max_retries=0, timeout=30).chat.completions.create(
                model=srv.engine.model_name, messages=CHAT, stream=True, max_tokens=400))
        except Exception as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    reader = threading.Thread(target=consume)
    reader.start()
    try:
        wait_for(lambda: srv.engine.stats()["running"] == 1, 20, "the request to run")
        srv.stop(timeout=0.2)  # drain for 0.2 s, then cancel: the stream ends cleanly
        reader.join(15)
        assert not reader.is_alive() and errors == []
        assert chunks[-1].choices[0].finish_reason is not None
    finally:
        srv.stop()
        reader.join(10)


@pytest.fixture(scope="module")
def bad_tls(tmp_path_factory: pytest.TempPathFactory, tls_files) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("bad-tls")
    _, other_key = make_tls_files(folder, "other")
    _, locked_key = make_tls_files(folder, "locked", password=b"secret")
    garbage = folder / "garbage.pem"
    garbage.write_text("not a certificate\n")
    return {"other_key": other_key, "locked_key": locked_key, "garbage": garbage,
            "folder": folder}


@pytest.mark.parametrize("case, message", [
    ("missing cert", r"ssl_certfile: no such file: .*nope\.crt"),
    ("missing key", r"ssl_keyfile: no such file: .*nope\.key"),
    ("cert is a folder", r"ssl_certfile: .*bad-tls\d* is not a file"),
    ("garbage cert", (r"ssl_certfile .*garbage\.pem and ssl_keyfile .*server\.key are not a "
                      r"PEM certificate and its private key")),
    ("key of another cert", (r"the key in .*other\.key does not belong to the certificate in "
                             r".*server\.crt")),
    ("encrypted key", r"the private key in .*locked\.key is encrypted"),
    ("key without cert", r"ssl_keyfile needs ssl_certfile"),
    ("share with TLS", r"share=True cannot be used with TLS"),
])
def test_bad_tls_files_are_clear_errors_before_the_server_starts(
        tiny_llama_dir, tls_files, bad_tls, case, message):
    cert, key = tls_files
    files = {
        "missing cert": (bad_tls["folder"] / "nope.crt", key),
        "missing key": (cert, bad_tls["folder"] / "nope.key"),
        "cert is a folder": (bad_tls["folder"], key),
        "garbage cert": (bad_tls["garbage"], key),
        "key of another cert": (cert, bad_tls["other_key"]),
        "encrypted key": (cert, bad_tls["locked_key"]),
        "key without cert": (None, key),
        "share with TLS": (cert, key),
    }[case]
    port = free_port()
    with pytest.raises(ValueError, match=message):
        launch(str(tiny_llama_dir), port=port, ssl_certfile=files[0], ssl_keyfile=files[1],
               share=case == "share with TLS")
    assert running_servers() == []
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing was bound


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="file permissions do not stop root (or apply off POSIX)")
def test_unreadable_key_is_a_clear_error(tiny_llama_dir, tls_files, tmp_path):
    cert, key = tls_files
    locked = tmp_path / "unreadable.key"
    locked.write_bytes(key.read_bytes())
    locked.chmod(0)
    with pytest.raises(ValueError, match=r"ssl_keyfile: cannot read .*unreadable\.key"):
        launch(str(tiny_llama_dir), ssl_certfile=cert, ssl_keyfile=locked)


@pytest.mark.slow
def test_cli_serves_https_and_prints_https_links(tiny_llama_dir, tls_files):
    cert, key = tls_files
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    bad = subprocess.run([sys.executable, "-m", "nbserve.serving.cli", "serve", str(tiny_llama_dir),
                          "--ssl-certfile", str(cert), "--ssl-keyfile", str(cert.parent / "x")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                         check=False)
    assert bad.returncode == 1 and "nbserve: error: ssl_keyfile: no such file" in bad.stderr
    proc = subprocess.Popen([sys.executable, "-m", "nbserve.serving.cli", "serve",
                             str(tiny_llama_dir), "--port", "0", "--max-batch", "2", "--no-ui",
                             "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        line = next((ln for ln in proc.stdout if " at http" in ln), "")
        assert " at https://127.0.0.1:" in line and "OpenAI API base https://" in line, line
        url = line.split(" at ")[1].split()[0]
        assert httpx.get(url + "/health", verify=trusting(cert), timeout=10).json()["ready"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
        proc.wait()
