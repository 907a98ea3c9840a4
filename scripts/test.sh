#!/usr/bin/env bash
# The whole test suite: what CI runs and what a newcomer runs.
#
# Installs what the tests need from Debian's packages when it is missing,
# builds the workspace in release mode (the integration tests drive the real
# binary and move gigabytes), runs the Rust tests, then the tests that drive
# real NBD clients (qemu-img, qemu-io, nbdinfo, nbdsh, python3-libnbd, nbdcopy).
#
# Tests that need root (mounts, loop devices) are `#[ignore = "needs root"]`
# in Rust and `pytest.skip` in Python: without root they are counted as
# ignored/skipped, never as passed. As root they all run.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian's python3-libnbd belongs to /usr/bin/python3, not to a pyenv shim.
export PATH="/usr/sbin:/usr/bin:/sbin:/bin:$HOME/.cargo/bin:$PATH"

is_root() { [ "$(id -u)" = 0 ]; }

scripts/deps.sh
# The kernel modules the fixtures use; harmless when built in or absent.
if is_root; then
    for m in loop xfs btrfs fuse; do modprobe "$m" 2>/dev/null || true; done
fi

cargo build --release --workspace --bins
export RAWDISK_BIN="$PWD/target/release/rawdisk"

status=0
if is_root; then
    cargo test --release --workspace --no-fail-fast -- --include-ignored || status=1
else
    cargo test --release --workspace --no-fail-fast || status=1
fi

if [ -d tests ] && ls tests/test_*.py >/dev/null 2>&1; then
    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests || status=1
fi
exit $status
