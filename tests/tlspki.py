"""Test PKI and TLS client helpers shared by the TLS and hostile tests: a CA,
a server and a client certificate and PSK files, made by openssl in a temp
directory (nothing secret is committed), and the client side of a TLS
connection (URIs for libnbd, an ssl context for raw sockets)."""

import contextlib
import os
import shutil
import ssl
import subprocess
import tempfile

PSK = "5eb1a8c1f0c4a9c2b4d2e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7"
OTHER = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"


def openssl(cwd, *args):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d, name):
    openssl(d, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{name}-key.pem", "-out", f"{name}-cert.pem", "-days", "2",
            "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")


def make_leaf(d, name, cn, ca, ext):
    openssl(d, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}-key.pem", "-out", f"{name}.csr", "-subj", f"/CN={cn}")
    with open(os.path.join(d, f"{name}.ext"), "w") as f:
        f.write(ext)
    openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}-cert.pem",
            "-CAkey", f"{ca}-key.pem", "-CAcreateserial", "-days", "2",
            "-out", f"{name}-cert.pem", "-extfile", f"{name}.ext")


@contextlib.contextmanager
def made_pki():
    """{name: directory}: srv (server, nbdkit/qemu layout), cli (CA and a
    client certificate), cli-nocert (CA only), cli-rogue (another CA), and
    psk / wrong-psk / mallory-psk directories holding keys.psk (qemu reads
    that name from its dir=). Removed on exit."""
    root = tempfile.mkdtemp(prefix="rawdisk-tls-")
    try:
        w = os.path.join(root, "work")
        os.mkdir(w)
        make_ca(w, "ca")
        make_ca(w, "rogue")
        make_leaf(w, "server", "localhost", "ca",
                  "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
        make_leaf(w, "client", "test client", "ca", "extendedKeyUsage=clientAuth\n")
        layout = {
            "srv": {"ca-cert.pem": "ca-cert.pem", "server-cert.pem": "server-cert.pem",
                    "server-key.pem": "server-key.pem"},
            "cli": {"ca-cert.pem": "ca-cert.pem", "client-cert.pem": "client-cert.pem",
                    "client-key.pem": "client-key.pem"},
            "cli-nocert": {"ca-cert.pem": "ca-cert.pem"},
            "cli-rogue": {"ca-cert.pem": "rogue-cert.pem"},
        }
        dirs = {}
        for name, files in layout.items():
            d = os.path.join(root, name)
            os.mkdir(d)
            for to, frm in files.items():
                shutil.copy(os.path.join(w, frm), os.path.join(d, to))
            dirs[name] = d
        for name, line in {"psk": f"alice:{PSK}\n", "wrong-psk": f"alice:{OTHER}\n",
                           "mallory-psk": f"mallory:{PSK}\n"}.items():
            d = os.path.join(root, name)
            os.mkdir(d)
            with open(os.path.join(d, "keys.psk"), "w") as f:
                f.write(line)
            dirs[name] = d
        yield dirs
    finally:
        shutil.rmtree(root, ignore_errors=True)


def psk_file(pki, name="psk"):
    return os.path.join(pki[name], "keys.psk")


def tls_uri(srv, query, user=None):
    """The nbds:// or nbds+unix:// URI of a running server with `query`
    (tls-certificates=... or tls-psk-file=...)."""
    u = f"{user}@" if user else ""
    if srv.sock:
        return f"nbds+unix://{u}/?socket={srv.sock}&{query}"
    return f"nbds://{u}127.0.0.1:{srv.port}/?{query}"


def client_context(pki):
    """An ssl context that trusts the test CA (no client certificate)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(os.path.join(pki["srv"], "ca-cert.pem"))
    return ctx


def tls_sock(raw, pki):
    """`raw` (after the server's STARTTLS ACK) wrapped in TLS, checking the
    server certificate against the test CA and the name localhost."""
    return client_context(pki).wrap_socket(raw, server_hostname="localhost")
