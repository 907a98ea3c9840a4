"""Start and stop the NBD server under test.

TEST_SERVER selects the implementation: `rawdisk` (default, what CI runs),
or `nbdkit` / `qemu-nbd`, reference servers used only to validate that the
tests themselves are right. Expectations only rawdisk meets (nbdkit 1.32 has
no fast zero, no block-size info, no handshake timeout) carry the
`rawdisk_only` marker.
"""

import os
import signal
import socket
import subprocess
import threading
import time
import urllib.parse

from helpers import process_report

SERVER_KIND = os.environ.get("TEST_SERVER", "rawdisk")
RAWDISK_BIN = os.environ.get(
    "RAWDISK_BIN",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target", "release", "rawdisk"))

# A test that hangs on a stuck server would hang CI; killing the server makes
# every client (libnbd, qemu, raw sockets) see EOF, so the test fails loudly
# and its fixtures still clean up.
WATCHDOG_SECONDS = float(os.environ.get("TEST_SERVER_WATCHDOG", "120"))
START_TIMEOUT = 15.0
STOP_TIMEOUT = 30.0


def free_tcp_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_argv(kind, target, sock=None, bind=None, read_only=False, export_name=None,
                cache=None, create=None, preallocation=None, pid_file=None, extra=()):
    if kind == "rawdisk":
        argv = [RAWDISK_BIN, "serve"]
        argv += ["--bind", bind] if bind else ["--socket", sock]
        if read_only:
            argv.append("--read-only")
        if export_name is not None:
            argv += ["--export-name", export_name]
        if cache:
            argv += ["--cache", cache]
        if create:
            argv += ["--create", str(create)]
        if preallocation:
            argv += ["--preallocation", preallocation]
        if pid_file:
            argv += ["--pid-file", pid_file]
        return argv + list(extra) + [target]
    if kind == "nbdkit":
        argv = ["nbdkit", "-f", "-P", pid_file]
        if bind:
            host, port = bind.rsplit(":", 1)
            argv += ["-i", host, "-p", port]
        else:
            argv += ["-U", sock]
        if read_only:
            argv.append("-r")
        if export_name is not None:
            argv += ["-e", export_name]
        # Validation aid: TEST_NBDKIT_FILTERS="--filter=noextents" makes the
        # reference server misbehave on purpose, to see the tests notice.
        argv += os.environ.get("TEST_NBDKIT_FILTERS", "").split()
        argv += ["file", f"file={target}"]
        if cache == "none":
            argv.append("cache=none")
        return argv + list(extra)
    if kind == "qemu-nbd":
        argv = ["qemu-nbd", "-f", "raw", "-t", "-e", "16", "--pid-file", pid_file, "--discard=unmap"]
        if bind:
            host, port = bind.rsplit(":", 1)
            argv += ["-b", host, "-p", port]
        else:
            argv += ["-k", sock]
        if read_only:
            argv.append("-r")
        if export_name is not None:
            argv += ["-x", export_name]
        argv += ["--cache=none", "--aio=native"] if cache == "none" else ["--cache=writeback"]
        return argv + list(extra) + [target]
    raise ValueError(f"unknown TEST_SERVER {kind!r}")


class ServerFailedToStart(Exception):
    pass


class Server:
    """One running server process, its socket and logs."""

    def __init__(self, workdir, target, kind=SERVER_KIND, tcp=False, **opts):
        self.kind = kind
        self.target = target
        self.opts = opts
        self.export_name = opts.get("export_name") or ""
        n = 0
        while os.path.exists(os.path.join(workdir, f"srv{n}.log")):
            n += 1
        self.sock = None if tcp else os.path.join(workdir, f"srv{n}.sock")
        # rawdisk binds port 0 and prints the port it got (no race with
        # concurrent test runs); the reference servers need a port up front.
        self.port = None if not tcp or kind == "rawdisk" else free_tcp_port()
        self.bind = f"127.0.0.1:{self.port or 0}" if tcp else None
        self.stdout_path = os.path.join(workdir, f"srv{n}.out")
        self.stderr_path = os.path.join(workdir, f"srv{n}.log")
        self.pid_file = opts.pop("pid_file", None)
        if kind != "rawdisk":
            # The reference servers say they are ready by writing a pid file.
            self.pid_file = os.path.join(workdir, f"srv{n}.pid")
        self.argv = server_argv(kind, target, sock=self.sock, bind=self.bind,
                                pid_file=self.pid_file, **opts)
        self.proc = None
        self.watchdog_fired = False
        self.printed_uri = None
        self.returncode = None

    # -- life cycle ---------------------------------------------------------

    def start(self, expect_ready=True):
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL)
        self._watchdog = threading.Timer(WATCHDOG_SECONDS, self._fire_watchdog)
        self._watchdog.daemon = True
        self._watchdog.start()
        if expect_ready:
            self._wait_ready()
        return self

    def _fire_watchdog(self):
        self.watchdog_fired = True
        self.proc.kill()

    def _wait_ready(self):
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailedToStart(
                    f"{self.argv} exited with {self.proc.returncode}: {self.stderr().strip()}")
            if self._ready():
                return
            time.sleep(0.02)
        self.proc.kill()
        raise ServerFailedToStart(f"{self.argv} not ready after {START_TIMEOUT}s: {self.stderr()}")

    def _ready(self):
        if self.kind == "rawdisk":
            # The contract: the URI is printed once the server accepts connections.
            with open(self.stdout_path, "rb") as f:
                out = f.read().decode(errors="replace")
            if "\n" not in out:
                return False
            self.printed_uri = out.splitlines()[0].strip()
            if self.sock is None:
                self.port = urllib.parse.urlparse(self.printed_uri).port
                assert self.port, f"no port in the printed URI {self.printed_uri!r}"
        elif not os.path.exists(self.pid_file) or os.path.getsize(self.pid_file) == 0:
            return False
        return self.sock is None or os.path.exists(self.sock)

    def wait_exit(self, timeout=STOP_TIMEOUT):
        try:
            self.returncode = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            report = process_report(self.proc.pid)
            self.proc.kill()
            self.returncode = self.proc.wait()
            raise AssertionError(f"server did not exit within {timeout}s; stderr: {self.stderr()}"
                                 f"\n{report}")
        finally:
            self._watchdog.cancel()
        return self.returncode

    def terminate(self, timeout=STOP_TIMEOUT):
        """SIGTERM and wait: the contract says finish in flight, flush, exit 0."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc:
            self._watchdog.cancel()

    # -- observation --------------------------------------------------------

    @property
    def pid(self):
        return self.proc.pid

    @property
    def uri(self):
        if self.sock:
            return f"nbd+unix:///{self.export_name}?socket={self.sock}"
        return f"nbd://127.0.0.1:{self.port}/{self.export_name}"

    def stderr(self):
        with open(self.stderr_path, "rb") as f:
            return f.read().decode(errors="replace")

    def status(self, field):
        """A field of /proc/PID/status in bytes (VmRSS, VmHWM, VmPeak...)."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    value, unit = line.split()[1:3]
                    assert unit == "kB"
                    return int(value) * 1024
        raise KeyError(field)

    def connect_unix_or_tcp(self, timeout=10.0):
        """A raw socket to the server, for the hostile client."""
        if self.sock:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout)
            s.connect(self.sock)
        else:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        return s

    def assert_alive(self):
        assert not self.watchdog_fired, "the watchdog had to kill the server (hung test)"
        assert self.proc.poll() is None, \
            f"server died with {self.proc.returncode}; stderr: {self.stderr()[-4000:]}"
        assert "panicked" not in self.stderr(), self.stderr()[-4000:]
