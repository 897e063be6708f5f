"""The lighthouse client's transport against a scripted HTTP stub: URL schemes, TLS, retries with
backoff, one-line errors, and the commit vote sent now and read later."""

from __future__ import annotations

import http.server
import itertools
import json
import random
import shutil
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest

from freescale.ft.client import LighthouseClient, LighthouseError, backoff_delays


# ---------------------------------------------------------------------- client transport: schemes, TLS, backoff
class _StubHandler(http.server.BaseHTTPRequestHandler):
    """Answers ``GET /v1/status`` with JSON on a keep-alive connection; the server's ``script``
    (a list of statuses, consumed one per request) makes it answer e.g. 503 first."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        server = self.server
        status = server.script.pop(0) if server.script else 200  # type: ignore[attr-defined]
        server.answered.append(status)  # type: ignore[attr-defined]
        body = json.dumps({"quorum_id": 7} if status == 200 else {"error": "busy\nrestarting"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        """``/v1/commit``: the vote's answer (``{commit: true}`` on 200), after the body was read."""
        self.rfile.read(int(self.headers["Content-Length"]))
        server = self.server
        status = server.script.pop(0) if server.script else 200  # type: ignore[attr-defined]
        server.answered.append(status)  # type: ignore[attr-defined]
        body = json.dumps({"commit": True} if status == 200 else {"error": "not now"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _StubServer(http.server.ThreadingHTTPServer):
    """Drops (accepts, then closes unanswered) its first ``refuse`` connections."""

    daemon_threads = True

    def __init__(self, refuse: int = 0, script: list[int] | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _StubHandler)
        self.refuse, self.dropped = refuse, 0
        self.script, self.answered = list(script or []), []
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def verify_request(self, request: object, client_address: object) -> bool:
        if self.dropped < self.refuse:
            self.dropped += 1
            return False  # socketserver closes it: the client sees a reset / closed connection
        return True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # e.g. a TLS handshake the client aborted (untrusted certificate)

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


@pytest.fixture
def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for IP 127.0.0.1 and its key (``openssl`` CLI; the ``cryptography`` package
    when installed instead)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    if shutil.which("openssl"):
        done = subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1"], capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            return cert, key
    try:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        pytest.skip("neither the openssl CLI nor the cryptography package can make a test certificate")
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                  critical=False)
                   .sign(private, hashes.SHA256()))
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return cert, key


def test_https_lighthouse_url_is_served_over_tls(self_signed: tuple[Path, Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``Lighthouse`` itself serves plain HTTP only, so a TLS stub answers ``/v1/status``; the client
    trusts its self-signed certificate through ``SSL_CERT_FILE`` (the default SSL context's way),
    keeps its connection alive, and refuses the certificate when it is not trusted."""
    cert, key = self_signed
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server = _StubServer(tls=tls)
    try:
        untrusted = LighthouseClient(server.url("https"), "a", 0, request_timeout_s=5)
        start = time.monotonic()
        with pytest.raises(LighthouseError, match="certificate") as refused:
            untrusted.status()
        assert time.monotonic() - start < 2, "an untrusted certificate is not retried until the timeout"
        assert "\n" not in str(refused.value) and server.url("https") in str(refused.value)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        c = LighthouseClient(server.url("https"), "a", 0, request_timeout_s=5)
        assert c.status() == {"quorum_id": 7}
        first = c._local.conn
        assert isinstance(first, http.client.HTTPSConnection)
        assert c.status() == {"quorum_id": 7} and c._local.conn is first  # keep-alive
        c.close()
    finally:
        server.close()


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:29500", "127.0.0.1:29500", "", "http://127.0.0.1:port"])
def test_unknown_scheme_is_a_one_line_error_naming_the_url(url: str) -> None:
    with pytest.raises(LighthouseError) as refused:
        LighthouseClient(url, "a", 0)
    assert repr(url) in str(refused.value) and "\n" not in str(refused.value)


def test_retries_back_off_until_the_lighthouse_answers() -> None:
    """The first connections are dropped and the next answer is a 503: the client retries them all,
    sleeping longer each time (20 ms doubling, drawn with full jitter: here the jitter's maximum)."""
    server = _StubServer(refuse=3, script=[503])
    try:
        c = LighthouseClient(server.url(), "a", 0, request_timeout_s=5)
        sleeps: list[float] = []
        c._sleep = lambda s: (sleeps.append(s), time.sleep(s))[1]  # type: ignore[method-assign]
        c._rng.uniform = lambda lo, hi: hi  # type: ignore[method-assign]
        assert c.status() == {"quorum_id": 7}
        assert server.dropped == 3 and server.answered == [503, 200]
        assert sleeps == pytest.approx([0.02, 0.04, 0.08, 0.16])
        # A keep-alive connection the server closed while idle is replaced at once, without a sleep.
        c._local.conn.sock.shutdown(socket.SHUT_RDWR)
        sleeps.clear()
        assert c.status() == {"quorum_id": 7} and sleeps == []
        c.close()
    finally:
        server.close()


def test_backoff_has_full_jitter_under_a_cap_and_the_deadline_bounds_it() -> None:
    rng = random.Random(0)
    delays = list(itertools.islice(backoff_delays(rng), 12))
    ceilings = [min(1.0, 0.02 * 2 ** k) for k in range(12)]
    assert all(0 <= d <= c for d, c in zip(delays, ceilings)) and len(set(delays)) == 12
    # A lighthouse that stays down: the error comes at the request timeout, not a backoff step later.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    c = LighthouseClient(f"http://127.0.0.1:{port}", "a", 0, request_timeout_s=0.4)
    start = time.monotonic()
    with pytest.raises(LighthouseError, match=rf"lighthouse http://127.0.0.1:{port} unreachable for /v1/quorum"):
        c.quorum(0)
    assert 0.4 <= time.monotonic() - start < 1.5  # (shared cores: generous)


def test_transient_answer_that_persists_and_a_refusal_are_one_line_errors() -> None:
    server = _StubServer(script=[503] * 1000)
    try:
        c = LighthouseClient(server.url(), "a", 0, request_timeout_s=0.3)
        with pytest.raises(LighthouseError) as failed:
            c.status()
        assert str(failed.value) == f"lighthouse {server.url()}/v1/status answered 503: busy restarting"
        assert len(server.answered) > 3  # retried
        server.script[:] = [404]
        server.answered.clear()
        with pytest.raises(LighthouseError, match=r"/v1/status answered 404: busy restarting$"):
            c.status()
        assert server.answered == [404]  # a 4xx is not retried
        c.close()
    finally:
        server.close()


def test_commit_vote_is_sent_now_and_read_later_with_the_retrying_path_behind_it() -> None:
    """``commit_async`` sends the vote on the thread's keep-alive connection and reads it when asked.
    A connection the server closed while idle, then a 503: the vote goes again through the retrying
    path and its answer is read; a refusal (409) is one line (the vote was sent twice: it is
    idempotent at the lighthouse)."""
    server = _StubServer(script=[200, 503, 200, 409, 409])
    try:
        c = LighthouseClient(server.url(), "a", 0, request_timeout_s=5)
        c._sleep = lambda s: None  # type: ignore[method-assign]
        outcome = c.commit_async(1, 0, True)
        assert server.answered == [] or server.answered == [200]  # sent; the answer is not read yet
        assert outcome() is True and server.answered == [200]
        c._local.conn.sock.shutdown(socket.SHUT_RDWR)  # the keep-alive closed under it
        assert c.commit_async(1, 1, True)() is True
        assert server.answered == [200, 503, 200]
        with pytest.raises(LighthouseError, match=r"/v1/commit answered 409: not now$"):
            c.commit_async(1, 2, True)()
        assert server.answered[-2:] == [409, 409]
        c.close()
    finally:
        server.close()
