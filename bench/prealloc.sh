#!/bin/bash
# bench/prealloc.sh -- `rawdisk create --preallocation falloc|full` beside
# `qemu-img create -f raw -o preallocation=...` on tmpfs, ramfs, ext4 and XFS,
# through the shared harness (../shared/bench/prealloc.sh, read its header),
# then its paired-ratio report (rawdisk time / qemu-img time, same repetition).
#
# Usage (root): bench/prealloc.sh            # all four targets
#   TARGETS="tmpfs ramfs" bench/prealloc.sh
# Environment: BENCH_REPS (default 3), PREALLOC_SIZE (6G), PREALLOC_MODES
# ("falloc full"), RAWDISK_BIN (default target/release/rawdisk, built if
# missing), SHARED_BENCH (default ../shared/bench). Results go to a fresh
# work dir so runs of teammates do not mix; its path is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED_BENCH=${SHARED_BENCH:-$PWD/../shared/bench}
BIN=${RAWDISK_BIN:-$PWD/target/release/rawdisk}
if [[ ! -x "$BIN" ]]; then
  cargo build --release -p rawdisk
fi
export BENCH_REPS=${BENCH_REPS:-3}
export PREALLOC_MODES=${PREALLOC_MODES:-falloc full}
export BENCH_WORK=${BENCH_WORK:-$(mktemp -d /tmp/rawdisk-prealloc-bench.XXXXXX)}
export BENCH_RESULTS=${BENCH_RESULTS:-$BENCH_WORK/results.tsv}
export TOOL_CMD="$BIN create --preallocation {mode} {file} {size}"
echo "prealloc bench: work dir $BENCH_WORK, tool: $TOOL_CMD" >&2
for t in ${TARGETS:-tmpfs ramfs ext4 xfs}; do
  "$SHARED_BENCH/prealloc.sh" "$t" qemu-img,custom
done
"$SHARED_BENCH/report.sh" "$BENCH_RESULTS" qemu-img
