#!/bin/bash
# bench/cbt-cost.sh -- the cost of `serve --track-changes`: fio random
# writes through `rawdisk serve` with and without tracking (a checkpoint
# taken first, so the newest bitmap is written), paired within each
# repetition. Not a test: prints medians and the paired ratio.
#
# Usage: bench/cbt-cost.sh DIR [BS FSYNC]...
#   DIR    a directory on the file system to measure (a 1 GiB file is made)
#   BS FSYNC  pairs: block size and a FLUSH every FSYNC writes (0: none);
#          default: 4k 0  1M 0  4k 32  1M 8
# Environment: RAWDISK_BIN (default target/release/rawdisk), REPS (5),
#   RUNTIME (4 s per run)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
: "${RAWDISK_BIN:=$HERE/../target/release/rawdisk}" "${REPS:=5}" "${RUNTIME:=4}"
[[ $# -ge 1 ]] || { echo "usage: bench/cbt-cost.sh DIR [BS FSYNC]..." >&2; exit 2; }
dir=$1; shift
[[ $# -gt 0 ]] || set -- 4k 0 1M 0 4k 32 1M 8
disk=$dir/cbt-cost.img sock=$dir/cbt-cost.sock
trap 'rm -f "$disk" "$disk.rawdisk-cbt" "$sock"' EXIT

run() { # run MODE BS FSYNC -> KiB/s
  rm -f "$sock" "$disk.rawdisk-cbt"
  local extra=()
  if [[ $1 == cbt ]]; then
    "$RAWDISK_BIN" checkpoint create "$disk" > /dev/null
    extra=(--track-changes)
  fi
  "$RAWDISK_BIN" serve --socket "$sock" "${extra[@]}" "$disk" > /dev/null 2>&1 &
  local pid=$!
  for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.05; done
  fio --name=j --ioengine=nbd --uri="nbd+unix:///?socket=$sock" --rw=randwrite \
    --bs="$2" --iodepth=16 --fsync="$3" --size=1G --time_based=1 --runtime="$RUNTIME" \
    --output-format=terse 2> /dev/null | tail -1 | awk -F';' '{print $48}'
  kill "$pid"; wait "$pid" 2> /dev/null || true
}

rm -f "$disk"; fallocate -l 1G "$disk" 2> /dev/null || truncate -s 1G "$disk"
echo "| writes | flush every | rawdisk KiB/s | --track-changes KiB/s | ratio median [min-max] |"
echo "|---|---|---|---|---|"
while [[ $# -ge 2 ]]; do
  bs=$1 fsync=$2; shift 2
  rows=""
  for _ in $(seq "$REPS"); do
    rows+="$(run plain "$bs" "$fsync") $(run cbt "$bs" "$fsync")"$'\n'
  done
  python3 -c 'import sys, statistics as st
rows = [l.split() for l in sys.stdin if l.strip()]
p = [float(r[0]) for r in rows]; c = [float(r[1]) for r in rows]
r = [b / a for a, b in zip(p, c)]
every = sys.argv[2] if sys.argv[2] != "0" else "never"
print(f"| {sys.argv[1]} qd16 | {every} | {st.median(p):,.0f} | {st.median(c):,.0f} | "
      f"{st.median(r):.2f} [{min(r):.2f}-{max(r):.2f}] |")' "$bs" "$fsync" <<<"$rows"
done
