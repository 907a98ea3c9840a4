"""Fixtures: the server under test (a command template chosen by TEST_SERVER),
the TLS test PKI, scratch directories, and storage stacks (tmpfs, ramfs,
ext4, XFS, btrfs, the NFS-like nfs3 and nfs42, loop devices) that need root.

Without root the storage fixtures skip with the reason "needs root", and the
NFS-like ones without /dev/fuse with that reason; as root a failure to build
them is an error, never a skip.
"""

import os
import signal

import pytest

import servers
import storage
import tlspki

SERVER_KIND = servers.SERVER_KIND


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):
    # A CI timeout or a plain `kill` sends SIGTERM: turn it into the
    # KeyboardInterrupt pytest handles by running every fixture's teardown,
    # so no mount, loop device or server outlives the run.
    signal.signal(signal.SIGTERM, _interrupt)
    config.addinivalue_line(
        "markers", "rawdisk_only(reason): an expectation reference servers do not meet")


def pytest_report_header(config):
    binary = servers.RAWDISK_BIN if SERVER_KIND == "rawdisk" else ""
    return f"server under test: {SERVER_KIND} {binary}"


def pytest_runtest_setup(item):
    for mark in item.iter_markers(name="rawdisk_only"):
        if SERVER_KIND != "rawdisk":
            reason = mark.args[0] if mark.args else "rawdisk-only expectation"
            pytest.skip(f"{SERVER_KIND}: {reason}")


def require_root():
    if not storage.is_root():
        pytest.skip("needs root")


@pytest.fixture(scope="session", autouse=True)
def server_binary_exists():
    if SERVER_KIND == "rawdisk" and not os.access(servers.RAWDISK_BIN, os.X_OK):
        pytest.fail(f"RAWDISK_BIN={servers.RAWDISK_BIN} is not an executable; "
                    "build it (cargo build --release -p rawdisk) or set RAWDISK_BIN")


@pytest.fixture
def workdir():
    """A unique directory on /tmp (ext4) for images, sockets and logs."""
    with storage.scratch_dir() as d:
        yield d


@pytest.fixture
def serve(workdir):
    """serve(target, read_only=..., export_name=..., cache=..., tcp=...) starts
    the server under test and returns a running `servers.Server`.

    At teardown every server still running gets SIGTERM and must exit 0
    without a panic: a clean shutdown is part of every test.
    """
    started = []

    def start(target, **opts):
        srv = servers.Server(workdir, target, **opts)
        started.append(srv)
        return srv.start()

    yield start

    problems = []
    for srv in started:
        try:
            if srv.proc is None:
                continue
            if srv.watchdog_fired:
                problems.append(f"watchdog killed {srv.argv} (test hung)")
            elif srv.returncode is not None:
                pass  # the test stopped it and checked the exit itself
            elif srv.proc.poll() is not None:
                problems.append(f"{srv.argv} died with {srv.proc.returncode} during the test: "
                                f"{srv.stderr()[-2000:]}")
            else:
                rc = srv.terminate()
                if rc != 0:
                    problems.append(f"{srv.argv} exited with {rc} on SIGTERM: {srv.stderr()[-2000:]}")
            if "panicked" in srv.stderr():
                problems.append(f"{srv.argv} panicked: {srv.stderr()[-2000:]}")
        except AssertionError as e:
            problems.append(str(e))
        finally:
            srv.kill()
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="session")
def pki():
    """The test PKI and PSK files (tlspki.made_pki), made once per run."""
    with tlspki.made_pki() as dirs:
        yield dirs


# -- storage (root only) -------------------------------------------------------

@pytest.fixture(scope="session")
def tmpfs_dir():
    require_root()
    with storage.tmpfs(512) as d:
        yield d


@pytest.fixture(scope="session")
def ramfs_dir():
    require_root()
    with storage.ramfs() as d:
        yield d


@pytest.fixture(scope="session")
def ext4_dir():
    require_root()
    with storage.filesystem_on_loop("ext4", 512) as d:
        yield d


@pytest.fixture(scope="session")
def xfs_dir():
    require_root()
    with storage.filesystem_on_loop("xfs", 512) as d:
        yield d


@pytest.fixture(scope="session")
def btrfs_dir():
    require_root()
    with storage.filesystem_on_loop("btrfs", 512) as d:
        yield d


def _nfs_like(profile):
    require_root()
    why = storage.fuse_unavailable()
    if why:
        pytest.skip(f"{profile}: {why}")
    # Latency 0: the functional suite counts operations, the benchmarks time them.
    return storage.nfs_like(profile, 1536, latency_us=0)


@pytest.fixture(scope="session")
def nfs3_dir():
    with _nfs_like("nfs3") as d:
        yield d


@pytest.fixture(scope="session")
def nfs42_dir():
    with _nfs_like("nfs42") as d:
        yield d


@pytest.fixture
def loop512():
    require_root()
    with storage.loop_on_tmpfs(512, 32) as dev:
        yield dev


@pytest.fixture
def loop4096():
    require_root()
    with storage.loop_on_tmpfs(4096, 32) as dev:
        yield dev


@pytest.fixture
def loop_on_ext4(ext4_dir):
    """A loop device whose backing file is on ext4, so its write-zeroes and
    discard become fallocate on that file (docs/capabilities.md, Loop devices)."""
    with storage.loop_on_dir(ext4_dir, 512, 32) as dev:
        yield dev


@pytest.fixture
def fs_dir(request):
    """Indirect parametrization: request.param names one of the fixtures above."""
    return request.getfixturevalue(request.param)
