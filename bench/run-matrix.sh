#!/bin/bash
# bench/run-matrix.sh -- reproduce the runs behind docs/benchmarks.md:
# rawdisk serve (page cache and O_DIRECT) and rawdisk create beside nbdkit,
# qemu-nbd and qemu-img, through the NBD benchmark harness (nbdkit/qemu-nbd/
# rawdisk side by side; not part of this repository: BENCH names its directory).
#
# Usage (as root, from anywhere):
#   bench/run-matrix.sh [PHASE...]      default: image convert zero throughput prealloc
#
# Environment:
#   BENCH          harness directory (required)
#   BENCH_WORK     private work dir (default target/bench-work) so that another
#                  run of the harness in its default dir cannot collide
#   BENCH_OUT      results dir (default $BENCH_WORK/results/matrix); phases run
#                  in several invocations append to the same results.tsv
#   RAWDISK_STABLE where the release binary is copied (default
#                  target/bench/rawdisk): a rebuild of target/release
#                  mid-run cannot change what is measured
#   SKIP_BUILD=1   reuse the binary already at RAWDISK_STABLE
#   BENCH_REPS, BENCH_PROFILE, *_TARGETS, sizes: passed to run-all.sh
# Afterwards: $BENCH_OUT/report.md (report.sh) and docs/plots/*.png (plot.py).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[[ -n "${BENCH:-}" ]] || { echo "run-matrix.sh: set BENCH to the directory of the NBD benchmark harness (nbdkit/qemu-nbd/rawdisk side by side)" >&2; exit 2; }
BENCH=$(cd "$BENCH" && pwd)
: "${BENCH_WORK:=$REPO/target/bench-work}"
: "${BENCH_OUT:=$BENCH_WORK/results/matrix}"
: "${RAWDISK_STABLE:=$REPO/target/bench/rawdisk}"
: "${BENCH_REPS:=3}"
export BENCH_WORK BENCH_OUT BENCH_REPS

mkdir -p "$(dirname "$RAWDISK_STABLE")" "$BENCH_OUT"
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  (cd "$REPO" && cargo build --release -p rawdisk)
  # cp to a temporary name and rename: a server still running the old binary
  # keeps its inode, and no run ever sees a half-copied file.
  cp "$REPO/target/release/rawdisk" "$RAWDISK_STABLE.new"
  mv -f "$RAWDISK_STABLE.new" "$RAWDISK_STABLE"
  {
    echo "built $(date -Is) from $(cd "$REPO" && git rev-parse HEAD)"
    (cd "$REPO" && git status --short --untracked-files=no)
  } >> "$BENCH_OUT/commit.txt"
fi
[[ -x "$RAWDISK_STABLE" ]] || { echo "no binary at $RAWDISK_STABLE" >&2; exit 1; }

R=$(printf '%q' "$RAWDISK_STABLE")
# custom = rawdisk with the page cache (its default), custom:direct = O_DIRECT,
export SERVER_CMD="$R serve --cache writeback --socket {socket} {file}"
export SERVER_CMD_direct="$R serve --cache none --socket {socket} {file}"
# custom (the default, --write-behind=auto) beside custom:wb (always on)
# and custom:wboff (never), to judge auto against both.
export SERVER_CMD_wb="$R serve --cache writeback --write-behind=on --socket {socket} {file}"
export SERVER_CMD_wboff="$R serve --cache writeback --write-behind=off --socket {socket} {file}"
# custom:mw = page cache with --map-writes (payloads received straight into
# the page cache; opt-in, see docs/architecture.md).
export SERVER_CMD_mw="$R serve --cache writeback --map-writes --socket {socket} {file}"
export TOOL_CMD="$R create --preallocation {mode} {file} {size}"
: "${BENCH_SERVERS:=nbdkit,qemu-nbd,qemu-nbd-direct,custom,custom:direct,custom:wb,custom:wboff,custom:mw}"
# --cache none is judged against the faster of qemu-nbd's native AIO and io_uring.
: "${TP_SERVERS:=nbdkit,qemu-nbd,qemu-nbd-direct,qemu-nbd-uring,custom,custom:direct,custom:wboff,custom:mw}"
: "${BENCH_TOOLS:=qemu-img,shell,custom}"
export BENCH_SERVERS TP_SERVERS BENCH_TOOLS

phases=("$@")
((${#phases[@]})) || phases=(image convert zero throughput prealloc)
# run-all.sh overwrites versions.txt: keep one per invocation.
bash "$BENCH/run-all.sh" "${phases[@]}"
cp "$BENCH_OUT/versions.txt" "$BENCH_OUT/versions-$(date +%H%M%S).txt"
/usr/bin/python3 "$REPO/bench/plot.py" "$BENCH_OUT/results.tsv" "$REPO/docs/plots" ||
  echo "plot.py failed (results are still in $BENCH_OUT)" >&2
