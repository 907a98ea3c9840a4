"""contrib/systemd: the rawdisk@.socket + rawdisk@.service pair, for the
system manager and (contrib/systemd/user) for `systemctl --user`. The
service's ExecStart and the socket's ListenStream are read from the files
(systemd's %i, %t and ${STATE_DIRECTORY} expanded as systemd would), the
command is run under `systemd-socket-activate`, and a real client reads and
writes through it: a broken unit fails here."""

import os
import re
import shlex
import shutil
import subprocess
import time

import nbd
import pytest

import servers
from helpers import MiB, assert_target_is, make_image, random_bytes, terminate

pytestmark = pytest.mark.rawdisk_only("the rawdisk command line")

UNITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "contrib", "systemd")
INSTANCE = "vm1"
# (the units' directory, where the socket listens, the manager's flag)
KINDS = {
    "system": (UNITS, "/run/rawdisk/%i.sock", []),
    "user": (os.path.join(UNITS, "user"), "%t/rawdisk/%i.sock", ["--user"]),
}
kinds = pytest.mark.parametrize("kind", sorted(KINDS))


def unit(name, kind="system"):
    """{section: {key: [values]}} of a unit file (comments dropped)."""
    sections, cur = {}, None
    with open(os.path.join(KINDS[kind][0], name)) as f:
        for line in f:
            line = line.strip()
            if not line or line[0] in "#;":
                continue
            m = re.fullmatch(r"\[(\w+)\]", line)
            if m:
                cur = sections.setdefault(m.group(1), {})
                continue
            k, v = line.split("=", 1)
            cur.setdefault(k.strip(), []).append(v.strip())
    return sections


def expand(value, env):
    """systemd's %i, %t and ${VAR} in a command line (what the units use)."""
    value = value.replace("%i", INSTANCE).replace("%I", INSTANCE)
    value = value.replace("%t", env.get("RUNTIME", "/run"))
    unknown = re.findall(r"%[a-zA-Z]", value)
    assert not unknown, f"specifier {unknown} this test does not expand"
    return re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], value)


@kinds
def test_units_pair_up(kind):
    sock, svc = unit("rawdisk@.socket", kind), unit("rawdisk@.service", kind)
    # Accept=no: one server gets the listening socket (what serve takes).
    assert sock["Socket"].get("Accept", ["no"]) == ["no"]
    assert sock["Socket"]["ListenStream"] == [KINDS[kind][1]]
    assert svc["Unit"]["Requires"] == ["rawdisk@%i.socket"]
    (exec_start,) = svc["Service"]["ExecStart"]
    argv = shlex.split(exec_start)
    assert os.path.basename(argv[0]) == "rawdisk" and argv[1] == "serve"
    assert "--socket" not in argv and "--bind" not in argv, "the socket unit listens"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@kinds
def test_units_verify(workdir, kind):
    """systemd's own parser accepts both units (the binary path pointed at
    the one under test, which systemd-analyze checks exists); the user
    units as a user manager reads them."""
    units, _, flag = KINDS[kind]
    env = dict(os.environ)
    if flag:
        env["XDG_RUNTIME_DIR"] = os.path.join(workdir, "runtime")
        os.mkdir(env["XDG_RUNTIME_DIR"], 0o700)
    for name in ("rawdisk@.socket", "rawdisk@.service"):
        with open(os.path.join(units, name)) as f:
            text = f.read()
        text = text.replace("/usr/local/bin/rawdisk", os.path.abspath(servers.RAWDISK_BIN))
        with open(os.path.join(workdir, name.replace("@.", f"@{INSTANCE}.")), "w") as f:
            f.write(text)
    res = subprocess.run(["systemd-analyze", *flag, "verify", "--man=no",
                          f"rawdisk@{INSTANCE}.socket", f"rawdisk@{INSTANCE}.service"],
                         cwd=workdir, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None,
                    reason="needs systemd-socket-activate")
@kinds
def test_socket_activated_service_serves(workdir, kind):
    state = os.path.join(workdir, "state")
    os.mkdir(state)
    path, model = make_image(state, f"{INSTANCE}.img", 4 * MiB, seed=71)
    env = {"STATE_DIRECTORY": state, "RUNTIME": os.path.join(workdir, "runtime")}
    (exec_start,) = unit("rawdisk@.service", kind)["Service"]["ExecStart"]
    argv = shlex.split(expand(exec_start, env))
    argv[0] = servers.RAWDISK_BIN
    (listen,) = unit("rawdisk@.socket", kind)["Socket"]["ListenStream"]
    listen = expand(listen, env)
    # The unit's socket, moved from /run into the test's directory.
    sock = os.path.join(workdir, os.path.basename(listen))
    log = open(os.path.join(workdir, "service.log"), "w+")
    proc = subprocess.Popen(["systemd-socket-activate", "-l", sock, *argv],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(500):
            if os.path.exists(sock):
                break
            assert proc.poll() is None, "systemd-socket-activate exited"
            time.sleep(0.01)
        uri = f"nbd+unix:///{INSTANCE}?socket={sock}"
        # The first connection starts the server; it must take the socket
        # it was given (a server that bound its own would not be reached).
        size = subprocess.run(["nbdinfo", "--size", uri], capture_output=True, text=True,
                              timeout=60)
        assert size.returncode == 0, size.stderr
        assert int(size.stdout) == 4 * MiB
        data = random_bytes(256 * 1024, seed=72)
        h = nbd.NBD()
        h.connect_uri(uri)
        h.pwrite(data, MiB - 4096)
        h.flush()
        assert h.pread(len(data), MiB - 4096) == data
        assert h.pread(4096, 0) == model[:4096]
        h.shutdown()
        model[MiB - 4096:MiB - 4096 + len(data)] = data
        assert proc.poll() is None, "the server stopped after its clients left"
    finally:
        terminate(proc)
        rc = proc.returncode
        log.seek(0)
        text = log.read()
        log.close()
    assert rc == 0, text
    # The journal's start line: the URI of the instance's export on the
    # activated socket (what is served and how is -v).
    assert f"{uri}\n" in text, text
    assert_target_is(path, model)
