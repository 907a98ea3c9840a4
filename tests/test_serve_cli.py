"""`rawdisk serve`'s second-round command line: the anchors' spellings
(qemu-nbd's -x and -D, nbdkit's --readonly, `-U -` and --log), --fork
leaving the caller's terminal, a quiet start that prints only a URI a
client can use, a bad --bind as a usage error, and a second server on a
socket in use leaving the first one's log clean."""

import json
import re
import shutil
import os
import signal
import stat
import subprocess
import time
import urllib.parse

import pytest

import servers
from helpers import MiB, assert_export_is, connected, make_image, terminate, wait_gone

pytestmark = pytest.mark.rawdisk_only("the rawdisk command line")


def rawdisk(*args, **kw):
    return subprocess.run([servers.RAWDISK_BIN, *args], capture_output=True, text=True,
                          timeout=60, **kw)


def test_qemu_nbd_and_nbdkit_spellings(workdir, serve):
    """-x NAME, -D TEXT and --readonly: the description is what nbdinfo
    --list and rawdisk info --list show, the export is read-only."""
    path, model = make_image(workdir, "disk.img", MiB, seed=11)
    srv = serve(path, extra=["-x", "vm", "-D", "the test disk", "--readonly"])
    assert srv.printed_uri == f"nbd+unix:///vm?socket={srv.sock}"
    base = f"nbd+unix:///?socket={srv.sock}"
    out = subprocess.run(["nbdinfo", "--list", "--json", base], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    [e] = json.loads(out.stdout)["exports"]
    assert (e["export-name"], e["description"], e["is_read_only"]) == \
        ("vm", "the test disk", True)
    r = rawdisk("info", "--list", "--output", "json", base)
    assert r.returncode == 0, r.stderr
    [e] = json.loads(r.stdout)["exports"]
    assert (e["export-name"], e["description"], e["is_read_only"]) == ("vm", "the test disk", True)
    r = rawdisk("info", "--output", "json", srv.printed_uri)
    assert json.loads(r.stdout)["exports"][0]["description"] == "the test disk", r.stdout
    assert_export_is(srv.printed_uri, model)
    with connected(srv.printed_uri) as h:
        assert h.is_read_only()


def test_private_socket_in_a_temporary_directory(workdir):
    """`-U -` with --run: $uri and $unixsocket name a socket alone in a new
    directory only its owner may enter; both are gone after exit."""
    path, model = make_image(workdir, "disk.img", MiB, seed=12)
    seen = os.path.join(workdir, "seen")
    script = (f'printf "%s\\n%s\\n" "$uri" "$unixsocket" > {seen}; '
              f'stat -c %a "$(dirname "$unixsocket")" >> {seen}; '
              f'ls -A "$(dirname "$unixsocket")" >> {seen}; '
              f'nbdcopy "$uri" {workdir}/copy.img')
    r = rawdisk("serve", "-U", "-", "--run", script, path)
    assert r.returncode == 0, r.stderr
    with open(seen) as f:
        uri, sock, mode, listing = f.read().splitlines()
    assert uri == f"nbd+unix:///?socket={sock}"
    assert os.path.basename(sock) == "socket" and listing == "socket"
    assert mode == "700"
    assert not os.path.exists(os.path.dirname(sock)), "the temporary directory is left behind"
    with open(os.path.join(workdir, "copy.img"), "rb") as f:
        assert f.read() == bytes(model)


def test_private_socket_printed_and_removed(workdir):
    path, model = make_image(workdir, "disk.img", MiB, seed=13)
    p = subprocess.Popen([servers.RAWDISK_BIN, "serve", "-U", "-", path],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        uri = p.stdout.readline().strip()
        sock = urllib.parse.parse_qs(urllib.parse.urlparse(uri).query)["socket"][0]
        assert stat.S_ISSOCK(os.stat(sock).st_mode)
        assert_export_is(uri, model)
    finally:
        terminate(p)
        assert p.returncode == 0
    assert not os.path.exists(os.path.dirname(sock))


def run_until_term(workdir, *args, signals=(signal.SIGUSR1,)):
    """Serves, sends `signals` then SIGTERM; returns (status, stdout, stderr)."""
    path, _ = make_image(workdir, "disk.img", MiB, seed=14)
    p = subprocess.Popen([servers.RAWDISK_BIN, "serve", "-U", f"{workdir}/s.sock", *args, path],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = p.stdout.readline()
    for s in signals:
        p.send_signal(s)
        time.sleep(0.3)
    rest, err = terminate(p)
    return p.returncode, out + rest, err


def test_log_destinations(workdir):
    status, _, err = run_until_term(workdir)
    assert status == 0 and "SIGUSR1" in err and "SIGTERM" in err, err
    status, _, err = run_until_term(workdir, "--log=null")
    assert status == 0 and err == "", err
    status, _, err = run_until_term(workdir, "--log", "syslog")
    # Everything goes to the system log; stderr says at most that there is none.
    assert status == 0 and "SIGTERM" not in err and "SIGUSR1" not in err, err
    assert err == "" or "/dev/log" in err, err
    r = rawdisk("serve", "--log=file", "-U", f"{workdir}/x.sock", "disk.img")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize("log", [None, "null", "stderr"])
def test_fork_leaves_the_callers_stderr(workdir, log):
    """--fork: once the command returned, the daemon writes nothing more to
    the caller's stderr unless --log=stderr keeps it."""
    path, _ = make_image(workdir, "disk.img", MiB, seed=15)
    pid_file = os.path.join(workdir, "serve.pid")
    errpath = os.path.join(workdir, "serve.err")
    extra = [f"--log={log}"] if log else []
    with open(errpath, "w") as err:
        r = subprocess.run([servers.RAWDISK_BIN, "serve", "--fork", "-U", f"{workdir}/s.sock",
                            "-P", pid_file, *extra, path],
                           stdout=subprocess.PIPE, stderr=err, text=True, timeout=30)
    assert r.returncode == 0
    with open(pid_file) as f:
        pid = int(f.read())
    try:
        os.kill(pid, signal.SIGUSR1)
        time.sleep(0.3)
    finally:
        os.kill(pid, signal.SIGTERM)
        wait_gone(pid)
    assert not os.path.exists(pid_file), "the pid file outlived the daemon"
    with open(errpath) as f:
        log_text = f.read()
    if log == "stderr":
        assert "SIGUSR1" in log_text and "SIGTERM" in log_text, log_text
    else:
        assert "SIGUSR1" not in log_text and "SIGTERM" not in log_text, log_text


def test_start_says_only_the_uri(workdir, serve):
    """No capability lines, no Debug names at start or at first use; -v
    has them, with the kind in words."""
    path, model = make_image(workdir, "disk.img", MiB, seed=16)
    srv = serve(path)
    assert_export_is(srv.printed_uri, model)
    with connected(srv.printed_uri) as h:
        h.zero(4096, 0)
    model[:4096] = bytes(4096)
    assert_export_is(srv.printed_uri, model)
    with open(srv.stdout_path) as f:
        assert f.read() == srv.printed_uri + "\n"
    assert srv.stderr() == "", srv.stderr()
    verbose = serve(path, extra=["-v"])
    assert_export_is(verbose.printed_uri, model)
    log_text = verbose.stderr()
    assert "storage capabilities" in log_text and "regular file" in log_text, log_text
    assert "File)" not in log_text, log_text


def test_wildcard_bind_prints_an_address_to_connect_to(workdir):
    path, model = make_image(workdir, "disk.img", MiB, seed=17)
    p = subprocess.Popen([servers.RAWDISK_BIN, "serve", "-b", "0.0.0.0:0", "-x", "vm", path],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        uri = p.stdout.readline().strip()
        u = urllib.parse.urlparse(uri)
        assert (u.scheme, u.hostname, u.path) == ("nbd", "localhost", "/vm"), uri
        assert u.port > 0
        assert_export_is(uri, model)
    finally:
        terminate(p)
        assert p.returncode == 0


def test_dir_says_how_to_list_the_exports(workdir):
    d = os.path.join(workdir, "images")
    os.mkdir(d)
    make_image(d, "a.img", MiB, seed=18)
    sock = os.path.join(workdir, "d.sock")
    p = subprocess.Popen([servers.RAWDISK_BIN, "serve", "--dir", d, "-U", sock],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        uri = p.stdout.readline().strip()
        assert uri == f"nbd+unix:///?socket={sock}"
        note = p.stderr.readline()
        assert f"rawdisk info --list '{uri}'" in note and f"nbdinfo --list '{uri}'" in note, note
        r = rawdisk("info", "--list", "--output", "json", uri)
        assert [e["export-name"] for e in json.loads(r.stdout)["exports"]] == ["a.img"]
    finally:
        terminate(p)
        assert p.returncode == 0


@pytest.mark.parametrize("bad", [("-b", "0.0.0.0:abc"), ("-b", "127.0.0.1:70000"),
                                 ("-b", "[::1"), ("-b", "99999"), ("--handshake-timeout", "0")])
def test_bad_values_are_usage_errors(workdir, bad):
    path, _ = make_image(workdir, "disk.img", MiB)
    r = rawdisk("serve", *bad, path)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "'rawdisk serve --help'" in r.stderr, r.stderr
    assert r.stdout == ""


def test_second_server_on_a_live_socket(workdir, serve):
    """The second server fails with one line and status 1; the first one
    logs nothing about its probe, keeps its socket and serves on."""
    path, model = make_image(workdir, "disk.img", MiB, seed=19)
    first = serve(path)
    for _ in range(3):
        r = rawdisk("serve", "-U", first.sock, path)
        assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
        assert f"cannot listen on '{first.sock}': it is in use by another server" in r.stderr, r.stderr
        assert r.stdout == ""
    time.sleep(0.3)
    assert first.stderr() == "", first.stderr()
    assert stat.S_ISSOCK(os.stat(first.sock).st_mode)
    assert_export_is(first.printed_uri, model)


SYSLOG_READER = """
import socket, subprocess, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind("/dev/log")
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
p.stdout.readline()
p.terminate()
assert p.wait() == 0 and p.stderr.read() == b"", "serve failed"
s.settimeout(2)
while True:
    try:
        sys.stdout.write(s.recv(65536).decode() + "\\n")
    except socket.timeout:
        break
"""


def test_syslog_lines(workdir):
    """--log=syslog: one datagram a message on /dev/log, facility daemon,
    the priority for the level. /dev/log is a private one, in a mount
    namespace of its own (root only)."""
    from conftest import require_root
    require_root()
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare")
    path, _ = make_image(workdir, "disk.img", MiB)
    serve_argv = [servers.RAWDISK_BIN, "serve", "--log=syslog", "-U", f"{workdir}/s.sock", path]
    script = ("mount -t tmpfs tmpfs /dev && mknod -m 666 /dev/null c 1 3 && "
              'exec /usr/bin/python3 -c "$0" "$@"')
    r = subprocess.run(["unshare", "-m", "sh", "-c", script, SYSLOG_READER, *serve_argv],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all(re.fullmatch(r"<30>rawdisk\[\d+\]: \S.*", x) for x in lines), \
        lines
    assert "SIGTERM" in lines[0] and "all connections closed" in lines[1], lines
