#!/bin/bash
# bench/prealloc.sh -- `rawdisk create --preallocation falloc|full` beside
# `qemu-img create -f raw -o preallocation=...` on tmpfs, ramfs, ext4 and XFS,
# through the NBD benchmark harness (its prealloc.sh, read its header),
# then its paired-ratio report (rawdisk time / qemu-img time, same repetition).
#
# Usage (root): bench/prealloc.sh            # all four targets
#   TARGETS="tmpfs ramfs" bench/prealloc.sh
# Environment: BENCH_REPS (default 3), PREALLOC_SIZE (6G), PREALLOC_MODES
# ("falloc full"), RAWDISK_BIN (default target/release/rawdisk, built if
# missing), BENCH (required: the harness directory). Results go to a fresh
# work dir so that two runs never mix; its path is printed.
set -euo pipefail
[[ -n "${BENCH:-}" ]] || { echo "prealloc.sh: set BENCH to the directory of the NBD benchmark harness (nbdkit/qemu-nbd/rawdisk side by side)" >&2; exit 2; }
BENCH=$(cd "$BENCH" && pwd)
cd "$(dirname "$0")/.."
BIN=${RAWDISK_BIN:-$PWD/target/release/rawdisk}
if [[ ! -x "$BIN" ]]; then
  cargo build --release -p rawdisk
fi
export BENCH_REPS=${BENCH_REPS:-3}
export PREALLOC_MODES=${PREALLOC_MODES:-falloc full}
export BENCH_WORK=${BENCH_WORK:-$(mktemp -d -t rawdisk-prealloc-bench.XXXXXX)}
export BENCH_RESULTS=${BENCH_RESULTS:-$BENCH_WORK/results.tsv}
export TOOL_CMD="$BIN create --preallocation {mode} {file} {size}"
echo "prealloc bench: work dir $BENCH_WORK, tool: $TOOL_CMD" >&2
for t in ${TARGETS:-tmpfs ramfs ext4 xfs}; do
  "$BENCH/prealloc.sh" "$t" qemu-img,custom
done
"$BENCH/report.sh" "$BENCH_RESULTS" qemu-img
