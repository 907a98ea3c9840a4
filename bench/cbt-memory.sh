#!/bin/bash
# bench/cbt-memory.sh -- memory and start time of `rawdisk serve
# --track-changes` against the target's size: a sparse file of SIZE, 0 to 4
# checkpoints created while stopped, then four 4 KiB writes far apart and a
# FLUSH through python3-libnbd. Not a test: prints, a row per checkpoint
# count, the medians over REPS runs of VmRSS, VmHWM (peak) and RssAnon
# (private) in KiB, read after the FLUSH, and of the time from exec to the
# URI being printed (the server listening). A first row serves untracked.
#
# Usage: bench/cbt-memory.sh DIR [SIZE]
#   DIR    a directory whose file system takes a sparse file of SIZE
#          (tmpfs, XFS; ext4 stops at 16 TiB)
#   SIZE   for truncate(1); default 64T
# Environment: RAWDISK_BIN (default target/release/rawdisk), REPS (3)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
: "${RAWDISK_BIN:=$HERE/../target/release/rawdisk}" "${REPS:=3}"
[[ $# -ge 1 ]] || { echo "usage: bench/cbt-memory.sh DIR [SIZE]" >&2; exit 2; }
dir=$1 size=${2:-64T}
img=$dir/cbt-memory.img sock=$dir/cbt-memory.sock out=$dir/cbt-memory.out
pid=
trap '[[ -z $pid ]] || kill "$pid" 2> /dev/null; rm -f "$img" "$img.rawdisk-cbt" "$sock" "$out"' EXIT

status() { awk -v f="$2:" '$1 == f { print $2 }' "/proc/$1/status"; }

once() { # once [serve options] -> "VmRSS VmHWM RssAnon start_ms"
  rm -f "$sock" "$out"
  local t0 t1
  t0=$(date +%s%N)
  "$RAWDISK_BIN" serve --socket "$sock" "$@" "$img" > "$out" 2> /dev/null &
  pid=$!
  until [[ -s $out ]]; do
    kill -0 "$pid" 2> /dev/null || { echo "rawdisk serve $* failed" >&2; exit 1; }
    sleep 0.001
  done
  t1=$(date +%s%N)
  /usr/bin/python3 -c 'import sys, nbd
h = nbd.NBD()
h.connect_uri(sys.argv[1])
size = h.get_size()
for i in range(4):
    h.pwrite(b"x" * 4096, min((size // 4) * i + 65536 * i, size - 4096))
h.flush()' "nbd+unix:///?socket=$sock"
  echo "$(status "$pid" VmRSS) $(status "$pid" VmHWM) $(status "$pid" RssAnon)" \
    "$(( (t1 - t0) / 1000 ))"
  kill -TERM "$pid"; wait "$pid"; pid=
}

row() { # row LABEL CHECKPOINTS [serve options]
  local label=$1 n=$2 rows="" i
  shift 2
  for _ in $(seq "$REPS"); do
    rm -f "$img.rawdisk-cbt"
    for ((i = 0; i < n; i++)); do
      "$RAWDISK_BIN" checkpoint create "$img" > /dev/null
    done
    rows+="$(once "$@")"$'\n'
  done
  /usr/bin/python3 -c 'import sys, statistics as st
cols = list(zip(*[map(int, l.split()) for l in sys.stdin if l.strip()]))
rss, hwm, anon, us = (st.median(c) for c in cols)
print(f"| {sys.argv[1]} | {sys.argv[2]} | {rss:,.0f} | {hwm:,.0f} | {anon:,.0f} | "
      f"{us / 1000:.1f} [{min(cols[3]) / 1000:.1f}-{max(cols[3]) / 1000:.1f}] |")' \
    "$size" "$label" <<< "$rows"
}

rm -f "$img" "$img.rawdisk-cbt"
truncate -s "$size" "$img"
echo "| size | serve | VmRSS KiB | VmHWM KiB | RssAnon KiB | start ms [min-max] |"
echo "|---|---|---|---|---|---|"
row "untracked" 0
for n in 0 1 2 3 4; do
  row "--track-changes, $n checkpoints" "$n" --track-changes
done
