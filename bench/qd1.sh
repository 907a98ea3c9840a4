#!/bin/bash
# bench/qd1.sh -- latency per request at queue depth 1 (what bounds
# `qemu-img convert` without -W): a libnbd client issues one request, waits
# for its reply, issues the next (bench/qd1.py). Servers as in the NBD
# benchmark harness (nbdkit, qemu-nbd, qemu-nbd-direct, custom[:NAME] with
# SERVER_CMD[_NAME]); their order rotates every repetition.
#
# Usage (root): bench/qd1.sh [SERVERS [TARGET]]
#   default SERVERS nbdkit,qemu-nbd-direct,custom; TARGET tmpfs
# Environment: QD1_JOBS (default "w:4096:5000 r:4096:5000 w:2097152:300
#   r:2097152:300", op:size:count; op r, w or f: a write and a
#   FLUSH), BENCH_REPS (default 5), RAWDISK_BIN,
#   BENCH (required): the harness directory, whose targets.sh builds TARGET.
# Prints the median microseconds per request for every job and server.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[[ -n "${BENCH:-}" ]] || { echo "qd1.sh: set BENCH to the directory of the NBD benchmark harness (nbdkit/qemu-nbd/rawdisk side by side)" >&2; exit 2; }
: "${RAWDISK_BIN:=$HERE/../target/release/rawdisk}"
# (Not ${SERVER_CMD:=...}: the "}" of {socket} would end that expansion.)
if [[ -z "${SERVER_CMD:-}" ]]; then
  SERVER_CMD="$(realpath "$RAWDISK_BIN") serve --socket {socket} {file}"
fi
export SERVER_CMD
: "${BENCH_REPS:=5}"
export BENCH_REPS
: "${QD1_JOBS:=w:4096:5000 r:4096:5000 w:2097152:300 r:2097152:300}"
# shellcheck source=/dev/null
source "$BENCH/targets.sh"
[[ $(id -u) == 0 ]] || die "needs root (mounts)"
IFS=, read -ra SERVERS <<<"${1:-nbdkit,qemu-nbd-direct,custom}"
TGT=${2:-tmpfs}
size=$((1 << 30))
target_setup "$TGT" "$size"
target_dirty
declare -A T
for ((rep = 0; rep < BENCH_REPS; rep++)); do
  mapfile -t order < <(rotate "$rep" "${SERVERS[@]}")
  for srv in "${order[@]}"; do
    server_start "$srv" "$TARGET_PATH" "$size" || die "server $srv failed"
    for job in $QD1_JOBS; do
      IFS=: read -r op bs n <<<"$job"
      T["$job $srv"]+="$(/usr/bin/python3 "$HERE/qd1.py" "$SRV_URI" "$op" "$bs" "$n") "
    done
    server_stop
  done
done
printf '| job (op:bytes:count) |'; printf ' %s |' "${SERVERS[@]}"; echo
printf '|---|'; printf -- '---|%.0s' "${SERVERS[@]}"; echo
for job in $QD1_JOBS; do
  printf '| %s |' "$job"
  for srv in "${SERVERS[@]}"; do
    printf ' %s |' "$(tr ' ' '\n' <<<"${T["$job $srv"]}" | grep . | sort -n |
      awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}')"
  done
  echo
done
target_teardown
