"""A real OCI registry for the release test: go-containerregistry's registry server (`crane
registry serve`, built from its Go module by deploy/build-crane.sh) behind TLS with a CA of its
own, so that Helm, crane and the nodes' containerd reach it as they reach any registry: by
HTTPS, trusting a CA they are given (SSL_CERT_FILE for the Go tools, hosts.toml for containerd).

crane's server speaks plain HTTP on the loopback only; TlsFront terminates TLS on the address
the cluster's nodes reach (the kind network's gateway) and relays the bytes. The server keeps
its blobs in a directory; everything goes with `close()`.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import re
import shutil
import ssl
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

START_TIMEOUT = 30.0
RELAY_CHUNK = 1 << 16


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_certificates(directory: Path, ip: str) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for `ip` (and localhost) signed by it: (ca, cert, key)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("dra-gpu release-test CA"))
        .issuer_name(_name("dra-gpu release-test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address(ip)),
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(ip))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = (directory / "ca.crt", directory / "registry.crt", directory / "registry.key")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return paths


class TlsFront:
    """Listens with TLS on (host, 0) and relays each connection to 127.0.0.1:backend_port."""

    def __init__(self, host: str, backend_port: int, cert: Path, key: Path) -> None:
        self.host, self.backend_port = host, backend_port
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="tls-front", daemon=True)

    def start(self) -> int:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(self._serve(), self.loop)
        self.port = started.result(timeout=START_TIMEOUT)
        return self.port

    async def _serve(self) -> int:
        self._server = await asyncio.start_server(self._relay, self.host, 0, ssl=self.context)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.backend_port)
        except OSError:
            writer.close()
            return

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(RELAY_CHUNK):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                dst.close()

        try:
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        except asyncio.CancelledError:
            # close(): the relay ends with its connections; returning (not raising) keeps
            # asyncio's server from logging each cancelled connection as an error.
            writer.close()
            up_writer.close()

    def close(self) -> None:
        """Stops listening, ends every relay and closes the loop: no coroutine is left for the
        garbage collector to finalise later (on a closed loop, at any point of the test run)."""

        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            relays = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in relays:
                task.cancel()
            await asyncio.gather(*relays, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive() and not self.loop.is_closed():
            self.loop.close()


class ReleaseRegistry:
    """crane's registry server behind a TlsFront on `host`; `name` is host:port, `ca_file` its CA."""

    def __init__(self, crane: str, host: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="dra-gpu-registry-"))
        (self.dir / "blobs").mkdir()
        self.ca_file, cert, key = make_certificates(self.dir, host)
        self.log = self.dir / "registry.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [crane, "registry", "serve", "--address", "127.0.0.1:0", "--disk", str(self.dir / "blobs")],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        backend = self._backend_port()
        self.front = TlsFront(host, backend, cert, key)
        self.name = f"{host}:{self.front.start()}"

    def _backend_port(self) -> int:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            found = re.search(r"serving on port (\d+)", self.log.read_text())
            if found:
                return int(found.group(1))
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"crane registry serve did not start:\n{self.log.read_text()[-2000:]}")

    def env(self) -> dict[str, str]:
        """The environment in which Go programs (helm, crane) trust the registry."""
        return dict(os.environ, SSL_CERT_FILE=str(self.ca_file))

    def close(self) -> None:
        self.front.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)
