#!/usr/bin/env bash
# A longer soak run of the server than the suite's 60 s (tests/test_soak.py):
# churn with abrupt closes, clients that never read, silent connections and
# verified random I/O at once; fails if a normal read waits a second or more,
# if descriptors or memory do not return to their baseline, or if any byte
# differs from the model.
#
#   scripts/soak.sh [--minutes N]     (default 10)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/sbin:/usr/bin:/sbin:/bin:$HOME/.cargo/bin:$PATH"

minutes=10
while [ $# -gt 0 ]; do
    case "$1" in
        --minutes) minutes="${2:?--minutes needs a number}"; shift 2 ;;
        --minutes=*) minutes="${1#*=}"; shift ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) echo "soak.sh: unknown argument '$1'" >&2; exit 2 ;;
    esac
done
case "$minutes" in
    ''|*[!0-9.]*) echo "soak.sh: --minutes wants a number, not '$minutes'" >&2; exit 2 ;;
esac
seconds=$(awk "BEGIN { printf \"%d\", $minutes * 60 }")

cargo build --release -p rawdisk
export RAWDISK_BIN="$PWD/target/release/rawdisk"
export SOAK_SECONDS="$seconds"
# The suite's watchdog kills a server after 120 s; this run is longer.
export TEST_SERVER_WATCHDOG=$((seconds + 300))
exec /usr/bin/python3 -m pytest -q -s -p no:cacheprovider tests/test_soak.py
