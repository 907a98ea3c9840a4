#!/bin/bash
# bench/zero-methods.sh -- zeroing benchmark of the storage engine:
# zero a fully written target on each storage kind (tmpfs, ramfs, ext4, xfs,
# loop 512, loop 4096, loop on tmpfs), per method through the engine (may_trim
# on/off, fast_only, and each later method of the chain forced by failing the
# earlier ones with EOPNOTSUPP through FaultSys), beside the plain tools on
# the same storage (fallocate -p, fallocate -z, blkdiscard -z, dd
# conv=fsync) as the limit; medians of BENCH_REPS. Also prints the
# capability matrix the engine learns on each kind. Not a test.
#
# Usage (root): bench/zero-methods.sh [--size 4G] [--reps 3] [--kinds tmpfs,ramfs,...] [--caps-only]
# Output: markdown on stdout (also saved to $BENCH_OUT, default
# target/zero-methods.md), progress on stderr.
#
# Needs about SIZE * 1.25 + 1 GiB of free RAM (checked before each kind).
# All storage is built in RAM by rawdisk-testkit (tmpfs-backed loop devices
# for ext4/xfs/loop), torn down when the run ends, also on failure. Run it on
# an otherwise idle machine: the rows are CPU-bound kernel paths.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH="/usr/sbin:/usr/bin:/sbin:/bin:$HOME/.cargo/bin:$PATH"
[ "$(id -u)" = 0 ] || { echo "zero-methods.sh: needs root (mount, losetup, mkfs)" >&2; exit 2; }
: "${BENCH_OUT:=target/zero-methods.md}"
cargo build --release -q -p rawdisk-storage --example zero_bench
mkdir -p "$(dirname "$BENCH_OUT")"
{
    echo "<!-- bench/zero-methods.sh $* ; $(date -u +%FT%TZ); $(uname -r); $(nproc) cpus; load $(cut -d' ' -f1-3 /proc/loadavg) -->"
    target/release/examples/zero_bench "$@"
} | tee "$BENCH_OUT"
