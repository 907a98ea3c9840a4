"""TLS with real peers in both directions. `rawdisk serve --tls-certificates`
/ `--tls-psk` read and written by libnbd (python3-libnbd, nbdinfo, nbdcopy)
and qemu (qemu-io, qemu-img with tls-creds-x509 / tls-creds-psk objects);
`rawdisk info/map/copy` against `nbdkit --tls=require` and `qemu-nbd
--tls-creds`; and the refusals, each followed by a good client reading the
export. The PKI and the PSK files come from the session's `pki` fixture
(tlspki.py, made by openssl in a temp dir)."""

import json
import os
import shutil
import socket
import struct
import subprocess
import time

import nbd
import pytest

import servers
import wire
from helpers import MiB, assert_same_bytes, assert_target_is, make_image, random_bytes
from tlspki import psk_file, tls_sock, tls_uri

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

pytestmark = pytest.mark.rawdisk_only("rawdisk's --tls flags")

SIZE = 8 * MiB


# -- servers and clients --------------------------------------------------------

def start(serve, workdir, tcp, *tls_args, seed=5, **opts):
    path, model = make_image(workdir, "disk.img", SIZE, seed=seed)
    return path, model, serve(path, tcp=tcp, extra=list(tls_args), **opts)


def handle(uri):
    h = nbd.NBD()
    # tls-certificates= and tls-psk-file= name local files.
    h.set_uri_allow_local_file(True)
    h.connect_uri(uri)
    return h


def read_all(h):
    return b"".join(h.pread(min(4 * MiB, h.get_size() - off), off)
                    for off in range(0, h.get_size(), 4 * MiB))


def assert_serves(uri, model):
    """A fresh libnbd client reads every byte over TLS."""
    h = handle(uri)
    try:
        assert h.get_tls_negotiated(), "TLS not negotiated"
        assert_same_bytes(read_all(h), model, "export read over TLS")
    finally:
        h.shutdown()


def assert_refused(uri):
    with pytest.raises(nbd.Error):
        h = handle(uri)
        h.pread(4096, 0)


# -- rawdisk serve with libnbd clients ----------------------------------------

@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_libnbd_x509_writes_multi_conn(workdir, serve, pki, tcp):
    path, model, srv = start(serve, workdir, tcp, "--tls-certificates", pki["srv"])
    assert srv.printed_uri.startswith("nbds+unix://" if not tcp else "nbds://"), srv.printed_uri
    uri = tls_uri(srv, f"tls-certificates={pki['cli-nocert']}")
    handles = [handle(uri) for _ in range(4)]
    for i, h in enumerate(handles):
        assert h.get_tls_negotiated()
        assert h.get_structured_replies_negotiated()
        assert h.can_multi_conn()
        data = random_bytes(MiB + 3, 100 + i)
        off = i * 2 * MiB + 5
        h.pwrite(data, off)
        model[off:off + len(data)] = data
    handles[3].flush()
    for h in handles:
        assert_same_bytes(read_all(h), model, "each connection sees every write")
        h.shutdown()
    assert_target_is(path, model)


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_libnbd_psk_writes(workdir, serve, pki, tcp):
    path, model, srv = start(serve, workdir, tcp, "--tls-psk", psk_file(pki))
    uri = tls_uri(srv, f"tls-psk-file={psk_file(pki)}", user="alice")
    h = handle(uri)
    assert h.get_tls_negotiated()
    assert h.get_tls_username() == "alice"
    data = random_bytes(3 * MiB, 9)
    h.pwrite(data, 4097)
    model[4097:4097 + len(data)] = data
    h.flush()
    assert_same_bytes(read_all(h), model, "read back over PSK")
    h.shutdown()
    assert_target_is(path, model)


def test_nbdinfo_nbdsh_and_nbdcopy(workdir, serve, pki):
    path, model, srv = start(serve, workdir, False, "--tls-certificates", pki["srv"])
    uri = tls_uri(srv, f"tls-certificates={pki['cli-nocert']}")
    info = subprocess.run(["nbdinfo", "--json", uri], capture_output=True, text=True, timeout=60)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["exports"][0]["export-size"] == SIZE
    src, src_model = make_image(workdir, "src.img", SIZE, seed=77)
    subprocess.run(["nbdcopy", "--flush", src, uri], check=True, timeout=120)
    assert_target_is(path, src_model)
    script = (f"h.set_uri_allow_local_file(True); h.connect_uri({uri!r}); "
              "assert h.get_tls_negotiated(); h.pwrite(b'\\xee' * 4096, 8191); h.flush()")
    # nbdsh runs `python3` from PATH; python3-libnbd belongs to /usr/bin's.
    env = dict(os.environ, PATH="/usr/bin:" + os.environ.get("PATH", ""))
    subprocess.run(["nbdsh", "-c", script], check=True, timeout=60, env=env)
    src_model[8191:8191 + 4096] = b"\xee" * 4096
    assert_target_is(path, src_model)
    out = os.path.join(workdir, "out.img")
    subprocess.run(["nbdcopy", uri, out], check=True, timeout=120)
    assert_target_is(out, src_model)
    psk_srv = start(serve, workdir, False, "--tls-psk", psk_file(pki), seed=6)[2]
    psk_uri = tls_uri(psk_srv, f"tls-psk-file={psk_file(pki)}", user="alice")
    info = subprocess.run(["nbdinfo", "--size", psk_uri], capture_output=True, text=True,
                          timeout=60)
    assert info.returncode == 0 and int(info.stdout) == SIZE, info.stderr


# -- rawdisk serve with qemu clients ------------------------------------------

def qemu_opts(srv, creds_id="tls0"):
    return (f"driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={srv.port},"
            f"tls-creds={creds_id}")


@pytest.mark.parametrize("kind", ["x509", "psk"])
def test_qemu_io_and_qemu_img(workdir, serve, pki, kind):
    if kind == "x509":
        path, model, srv = start(serve, workdir, True, "--tls-certificates", pki["srv"])
        obj = f"tls-creds-x509,id=tls0,dir={pki['cli-nocert']},endpoint=client"
    else:
        path, model, srv = start(serve, workdir, True, "--tls-psk", psk_file(pki))
        obj = f"tls-creds-psk,id=tls0,dir={pki['psk']},username=alice,endpoint=client"
    res = subprocess.run(["qemu-io", "--object", obj, "--image-opts",
                          "-c", "write -P 0xab 65536 1M", "-c", "read -P 0xab 65536 1M",
                          qemu_opts(srv)], capture_output=True, text=True, timeout=60)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "verification failed" not in out and "error" not in out, out
    model[65536:65536 + MiB] = b"\xab" * MiB
    src, src_model = make_image(workdir, "src.img", 2 * MiB, seed=3)
    subprocess.run(["qemu-img", "convert", "-n", "-f", "raw", "--object", obj,
                    "--target-image-opts", src, qemu_opts(srv)],
                   check=True, timeout=60, capture_output=True)
    model[:2 * MiB] = src_model
    out = os.path.join(workdir, "out.img")
    subprocess.run(["qemu-img", "convert", "-O", "raw", "--object", obj, "--image-opts",
                    qemu_opts(srv), out], check=True, timeout=60, capture_output=True)
    assert_target_is(out, model)
    assert_target_is(path, model)


# -- refusals, each followed by a good client ------------------------------------

def test_refusals_x509(workdir, serve, pki):
    _, model, srv = start(serve, workdir, True, "--tls-certificates", pki["srv"])
    good = tls_uri(srv, f"tls-certificates={pki['cli-nocert']}")
    # A plaintext client to a server that requires TLS.
    assert_refused(f"nbd://127.0.0.1:{srv.port}/")
    assert_serves(good, model)
    # An untrusted server certificate on the client.
    assert_refused(tls_uri(srv, f"tls-certificates={pki['cli-rogue']}"))
    assert_serves(good, model)
    srv.assert_alive()


def test_refusals_psk(workdir, serve, pki):
    _, model, srv = start(serve, workdir, False, "--tls-psk", psk_file(pki))
    good = tls_uri(srv, f"tls-psk-file={psk_file(pki)}", user="alice")
    assert_refused(tls_uri(srv, f"tls-psk-file={psk_file(pki, 'wrong-psk')}", user="alice"))
    assert_serves(good, model)
    assert_refused(tls_uri(srv, f"tls-psk-file={psk_file(pki, 'mallory-psk')}", user="mallory"))
    assert_serves(good, model)
    srv.assert_alive()


def test_psk_refusals_are_logged_in_sentences(workdir, serve, pki):
    """The server's log names the user and what to check, not OpenSSL's
    reason ("no suitable signature algorithm", "binder does not verify")."""
    _, model, srv = start(serve, workdir, False, "--tls-psk", psk_file(pki))
    assert_refused(tls_uri(srv, f"tls-psk-file={psk_file(pki, 'mallory-psk')}", user="mallory"))
    assert_refused(tls_uri(srv, f"tls-psk-file={psk_file(pki, 'wrong-psk')}", user="alice"))
    assert_serves(tls_uri(srv, f"tls-psk-file={psk_file(pki)}", user="alice"), model)
    log = srv.stderr()
    unknown = [line for line in log.splitlines() if "mallory" in line]
    assert len(unknown) == 1, log
    assert "unknown PSK identity \"mallory\"" in unknown[0], log
    assert psk_file(pki) in unknown[0] and "user name" in unknown[0], log
    wrong = [line for line in log.splitlines() if "\"alice\"" in line]
    assert len(wrong) == 1 and "another key" in wrong[0] and psk_file(pki) in wrong[0], log
    for openssl_words in ("signature algorithm", "binder"):
        assert openssl_words not in log, log


@pytest.mark.parametrize("name,content,says", [
    ("server-cert.pem", "not a certificate\n", "no PEM block"),
    ("server-cert.pem", "-----BEGIN CERTIFICATE-----\nMIIB!!!!\n-----END CERTIFICATE-----\n",
     "damaged"),
    ("server-key.pem", "not a key\n", "nothing OpenSSL reads"),
])
def test_credential_files_that_do_not_parse_are_one_sentence(workdir, pki, name, content,
                                                            says):
    d = os.path.join(workdir, "bad-pki")
    shutil.copytree(pki["srv"], d)
    with open(os.path.join(d, name), "w") as f:
        f.write(content)
    r = run_serve(workdir, "--tls-certificates", d)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and name in lines[0] and says in lines[0], r.stderr
    # OpenSSL's source files and error codes are not for the operator.
    assert ".c:" not in r.stderr and "error:0" not in r.stderr, r.stderr


def test_the_documented_certificates_work_on_this_machine(workdir, serve):
    """docs/architecture.md's openssl commands, run as written, make a
    server directory that nbdinfo trusts at localhost, 127.0.0.1 and the
    host's own name."""
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        doc = f.read()
    block = doc.split("Certificates in nbdkit's and qemu's layout", 1)[1]
    script = block.split("```sh\n", 1)[1].split("```", 1)[0]
    d = os.path.join(workdir, "pki-doc")
    os.mkdir(d)
    subprocess.run(["bash", "-euc", script], cwd=d, check=True, capture_output=True,
                   timeout=60)
    cli = os.path.join(workdir, "pki-doc-client")
    os.mkdir(cli)
    shutil.copy(os.path.join(d, "ca-cert.pem"), cli)
    _, model, srv = start(serve, workdir, True, "--tls-certificates", d)
    for host in ("localhost", "127.0.0.1", socket.gethostname()):
        if host == socket.gethostname():
            try:
                socket.getaddrinfo(host, srv.port)
            except OSError:
                continue  # a host name this machine cannot resolve
        uri = f"nbds://{host}:{srv.port}/?tls-certificates={cli}"
        r = subprocess.run(["nbdinfo", "--size", uri], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0 and int(r.stdout) == SIZE, (host, r.stderr)


def test_verify_peer_needs_a_client_certificate(workdir, serve, pki):
    srv_dir = pki["srv"]
    _, model, srv = start(serve, workdir, True, "--tls-certificates", srv_dir,
                          "--tls-verify-peer", "-v")
    assert_refused(tls_uri(srv, f"tls-certificates={pki['cli-nocert']}"))
    assert_serves(tls_uri(srv, f"tls-certificates={pki['cli']}"), model)
    # -v logs the version, cipher and who the peer is.
    assert "peer certificate CN=test client" in srv.stderr(), srv.stderr()[-2000:]


def go(c):
    c.go(ask_block_size=True)
    return c.tx_flags


def test_starttls_then_plaintext_options_are_discarded(workdir, serve, pki):
    _, model, srv = start(serve, workdir, True, "--tls-certificates", pki["srv"])
    raw = srv.connect_unix_or_tcp()
    c = wire.RawClient(raw).start()
    # STARTTLS and a plaintext GO in one segment: never answered, never fed to TLS.
    go_data = struct.pack(">IH", 0, 0)
    raw.sendall(struct.pack(">QII", wire.IHAVEOPT, wire.OPT_STARTTLS, 0)
                + struct.pack(">QII", wire.IHAVEOPT, wire.OPT_GO, len(go_data)) + go_data)
    assert c.read_option_reply() == (wire.OPT_STARTTLS, wire.REP_ACK, b"")
    c.sock = tls_sock(raw, pki)
    go(c)
    err, data = c.request(wire.CMD_READ, 0, 65536)
    assert err == 0 and data == model[:65536]
    c.disconnect()


def test_structured_replies_before_starttls_are_forgotten(workdir, serve, pki):
    _, model, srv = start(serve, workdir, True, "--tls", "on", "--tls-certificates", pki["srv"])
    raw = srv.connect_unix_or_tcp()
    c = wire.RawClient(raw).start()
    c.send_option(wire.OPT_STRUCTURED_REPLY)
    assert c.read_option_reply()[1] == wire.REP_ACK
    c.send_option(wire.OPT_STARTTLS)
    assert c.read_option_reply()[1] == wire.REP_ACK
    c.sock = tls_sock(raw, pki)
    flags = go(c)
    assert not flags & (1 << 7), "NBD_FLAG_SEND_DF without structured replies"
    # read_simple_reply asserts the simple reply magic.
    err, data = c.request(wire.CMD_READ, 4096, 4096)
    assert err == 0 and data == model[4096:8192]
    c.disconnect()


def test_unread_replies_are_capped_per_connection(workdir, serve, pki):
    """64 reads of 1 MiB pipelined over one TLS connection whose client
    reads nothing for 1.5 s: the server makes at most TLS_UNSENT_CONN (2 MiB)
    of replies ahead of the socket, so its anonymous memory stays near its
    baseline (it grew by under 0.1 MiB), not by the 64 MiB asked for (a
    build without the cap grew by 59 MiB). Then every reply is read and
    checked."""
    _, model, srv = start(serve, workdir, True, "--tls-certificates", pki["srv"])
    raw = srv.connect_unix_or_tcp(timeout=30)
    c = wire.RawClient(raw).start()
    c.send_option(wire.OPT_STARTTLS)
    assert c.read_option_reply()[1] == wire.REP_ACK
    c.sock = tls_sock(raw, pki)
    go(c)
    # Warm: the buffers one 1 MiB read needs are part of the baseline.
    assert c.request(wire.CMD_READ, 0, MiB) == (0, bytes(model[:MiB]))
    base = srv.status("RssAnon")
    offsets = [(i % 8) * MiB for i in range(64)]
    c.sock.sendall(b"".join(wire.request_bytes(wire.CMD_READ, off, MiB, cookie=i)
                            for i, off in enumerate(offsets)))
    peak, end = base, time.monotonic() + 1.5
    while time.monotonic() < end:
        peak = max(peak, srv.status("RssAnon"))
        time.sleep(0.02)
    assert peak - base < 16 * MiB, f"RssAnon grew by {(peak - base) >> 20} MiB"
    got = {}
    for _ in offsets:
        cookie, err, data = c.read_simple_reply(MiB)
        assert err == 0 and cookie not in got, (cookie, err)
        got[cookie] = data
    for i, off in enumerate(offsets):
        assert_same_bytes(got[i], model[off:off + MiB], f"read {i} at {off}")
    c.disconnect()


def test_stalled_tls_handshake_is_timed_out(workdir, serve, pki):
    _, model, srv = start(serve, workdir, True, "--tls-certificates", pki["srv"],
                          "--handshake-timeout", "1")
    raw = srv.connect_unix_or_tcp()
    c = wire.RawClient(raw).start()
    c.send_option(wire.OPT_STARTTLS)
    assert c.read_option_reply()[1] == wire.REP_ACK
    raw.sendall(b"\x16\x03")  # half a TLS record header, then silence
    t0 = time.monotonic()
    assert wire.wait_for_close(raw, 10), "the server kept a stalled TLS handshake open"
    assert time.monotonic() - t0 < 5
    assert_serves(tls_uri(srv, f"tls-certificates={pki['cli-nocert']}"), model)


# -- serve's command line -------------------------------------------------------

def run_serve(workdir, *args):
    path = os.path.join(workdir, "x.img")
    with open(path, "wb") as f:
        f.truncate(MiB)
    return subprocess.run([servers.RAWDISK_BIN, "serve", "--socket",
                           os.path.join(workdir, "x.sock"), *args, path],
                          capture_output=True, text=True, timeout=30)


def test_serve_tls_usage_errors(workdir, pki):
    r = run_serve(workdir, "--tls", "require")
    assert r.returncode == 2 and "--tls-certificates" in r.stderr, r.stderr
    r = run_serve(workdir, "--tls-verify-peer", "--tls-psk", psk_file(pki))
    assert r.returncode == 2, r.stderr
    r = run_serve(workdir, "--tls-certificates", pki["cli"])
    assert r.returncode == 1 and "server-cert.pem" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- rawdisk as the client against nbdkit and qemu-nbd --------------------------

class RefServer:
    def __init__(self, argv, sock=None, port=None):
        self.sock, self.port = sock, port
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read().decode()
            try:
                if sock:
                    socket.socket(socket.AF_UNIX).connect(sock)
                else:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"{argv} did not start")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def ref_server():
    started = []

    def start_ref(argv, **kw):
        s = RefServer(argv, **kw)
        started.append(s)
        return s

    yield start_ref
    for s in started:
        s.stop()


def rawdisk(*args):
    return subprocess.run([servers.RAWDISK_BIN, *args], capture_output=True, text=True,
                          timeout=120)


def copy_both_ways(workdir, uri, path, model, seed, *args):
    """rawdisk copy from the export to a file, then a new image onto the
    export; both compared byte for byte (the export through its file)."""
    out = os.path.join(workdir, "out.img")
    r = rawdisk("copy", *args, uri, out)
    assert r.returncode == 0, r.stderr
    assert_target_is(out, model)
    src, src_model = make_image(workdir, "src.img", SIZE, seed=seed)
    r = rawdisk("copy", *args, src, uri)
    assert r.returncode == 0, r.stderr
    assert_target_is(path, src_model)


@pytest.mark.parametrize("kind", ["x509", "psk"])
def test_rawdisk_client_against_nbdkit(workdir, pki, ref_server, kind):
    path, model = make_image(workdir, "ref.img", SIZE, seed=21, sparse=True)
    sock = os.path.join(workdir, "nbdkit.sock")
    creds = ([f"--tls-certificates={pki['srv']}"] if kind == "x509"
             else [f"--tls-psk={psk_file(pki)}"])
    ref_server(["nbdkit", "-f", "-U", sock, "--tls=require", *creds, "file", f"file={path}"],
               sock=sock)
    query = (f"tls-certificates={pki['cli-nocert']}" if kind == "x509"
             else f"tls-psk-file={psk_file(pki)}")
    user = "alice@" if kind == "psk" else ""
    uri = f"nbds+unix://{user}/?socket={sock}&{query}"

    r = rawdisk("info", "--output", "json", uri)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["TLS"], doc["exports"][0]["export-size"]) == (True, SIZE), r.stdout
    r = rawdisk("map", uri)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    r = rawdisk("info", "--list", "--output", "json", uri)
    assert r.returncode == 0, r.stderr
    assert [(e["export-name"], e["export-size"])
            for e in json.loads(r.stdout)["exports"]] == [("", SIZE)], r.stdout
    r = rawdisk("info", "--list", f"nbd+unix:///?socket={sock}")
    assert r.returncode == 1 and "requires TLS" in r.stderr, r.stderr
    copy_both_ways(workdir, uri, path, model, 22)

    r = rawdisk("info", f"nbd+unix:///?socket={sock}")
    assert r.returncode != 0 and "nbds://" in r.stderr, r.stderr
    wrong = f"nbds+unix:///?socket={sock}&tls-certificates={pki['cli-rogue']}"
    if kind == "x509":
        r = rawdisk("info", wrong)
        assert r.returncode != 0 and "certificate" in r.stderr, r.stderr


def test_rawdisk_client_against_qemu_nbd(workdir, pki, ref_server):
    path, model = make_image(workdir, "ref.img", SIZE, seed=31)
    port = servers.free_tcp_port()
    ref_server(["qemu-nbd", "-f", "raw", "-t", "-e", "4", "-b", "127.0.0.1", "-p", str(port),
                "--object", f"tls-creds-x509,id=tls0,dir={pki['srv']},endpoint=server",
                "--tls-creds", "tls0", path], port=port)
    # qemu's server credentials default to verify-peer=on: our client must
    # present cli/client-cert.pem, and without it is refused.
    r = rawdisk("info", f"nbds://127.0.0.1:{port}/?tls-certificates={pki['cli-nocert']}")
    assert r.returncode != 0 and "requires a client certificate" in r.stderr, r.stderr
    uri = f"nbds://127.0.0.1:{port}/?tls-certificates={pki['cli']}"
    copy_both_ways(workdir, uri, path, model, 32, "--connections", "4")
    r = rawdisk("info", f"nbd://127.0.0.1:{port}/")
    assert r.returncode != 0 and "nbds://" in r.stderr, r.stderr


def test_rawdisk_copy_refusals_are_sentences_said_at_once(workdir, pki, ref_server):
    """Refused credentials, against nbdkit (x509 with a required client
    certificate, PSK) and qemu-nbd: a copy asking for several connections
    fails at once (nothing is retried) with one line that says which file or
    user the server refused, once."""
    path, model = make_image(workdir, "ref.img", SIZE, seed=41)
    out = os.path.join(workdir, "out.img")
    sock = os.path.join(workdir, "nbdkit.sock")
    x509 = f"--tls-certificates={pki['srv']}"
    nocert = ("tls-certificates=" + pki["cli-nocert"],
              f"the server requires a client certificate (client-cert.pem in {pki['cli-nocert']})")
    rogue = ("tls-certificates=" + pki["cli-rogue"],
             f"the server's certificate is not signed by ca-cert.pem in {pki['cli-rogue']}"
             " (or pass tls-verify-peer=0)")
    wrong_key = ("tls-psk-file=" + psk_file(pki, "wrong-psk"),
                 "the server rejected the key for user alice")
    port = servers.free_tcp_port()
    cases = [
        (["nbdkit", "-f", "-U", sock, "--tls=require", x509, "--tls-verify-peer",
          "file", f"file={path}"], dict(sock=sock),
         f"nbds+unix:///?socket={sock}&", "", [nocert, rogue]),
        (["nbdkit", "-f", "-U", sock, "--tls=require", f"--tls-psk={psk_file(pki)}",
          "file", f"file={path}"], dict(sock=sock),
         f"nbds+unix://alice@/?socket={sock}&", f"nbd+unix:///?socket={sock}", [wrong_key]),
        (["qemu-nbd", "-f", "raw", "-t", "-b", "127.0.0.1", "-p", str(port), "--object",
          f"tls-creds-x509,id=tls0,dir={pki['srv']},endpoint=server", "--tls-creds", "tls0",
          path], dict(port=port),
         f"nbds://127.0.0.1:{port}/?", f"nbd://127.0.0.1:{port}/", [nocert, rogue]),
    ]
    for argv, where, base, plain, refusals in cases:
        if os.path.exists(sock):
            os.unlink(sock)
        srv = ref_server(argv, **where)
        tries = [(base + q, said) for q, said in refusals]
        if plain:
            tries.append((plain, "the server requires TLS: connect with an nbds://"))
        for uri, said in tries:
            t0 = time.monotonic()
            r = rawdisk("copy", "-C", "4", uri, out)
            took = time.monotonic() - t0
            assert r.returncode == 1, (argv[0], uri, r.stderr)
            assert r.stderr.count(said) == 1, (argv[0], said, r.stderr)
            assert r.stderr.count("\n") == 1, r.stderr
            assert took < 0.5, (argv[0], uri, took, r.stderr)
            assert not os.path.exists(out), out
        srv.stop()
    assert_target_is(path, model, "the served file")
