#!/bin/bash
# bench/map.sh -- `rawdisk map` beside `qemu-img map` against the number of
# extents: files with one 4 KiB data block in every 8 KiB (N data extents,
# 2N runs), the whole map and a 64 MiB range in the middle, as JSON to
# /dev/null. Not a test: prints the median time and peak RSS (GNU time) of
# REPS runs per row, as the table of docs/benchmarks.md (map).
#
# Usage: bench/map.sh DIR [N]...
#   DIR  a directory on the file system to measure (tmpfs: the data blocks
#        take N * 4 KiB of memory); the files are removed afterwards
#   N    data extents per file; default: 1000 100000 1000000
# Environment: RAWDISK_BIN (default target/release/rawdisk), REPS (3)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
: "${RAWDISK_BIN:=$HERE/../target/release/rawdisk}" "${REPS:=3}"
[[ $# -ge 1 ]] || { echo "usage: bench/map.sh DIR [N]..." >&2; exit 2; }
dir=$1; shift
[[ $# -gt 0 ]] || set -- 1000 100000 1000000
img=$dir/map-bench.img
trap 'rm -f "$img"' EXIT

make_file() { # make_file N
  /usr/bin/python3 - "$img" "$1" <<'EOF'
import os, sys
path, n = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
os.ftruncate(fd, n * 8192)
block = b"x" * 4096
for i in range(n):
    os.pwrite(fd, block, i * 8192 + 4096)
os.close(fd)
EOF
}

median() { # median COLUMN < lines of numbers
  sort -n -k"$1" | awk -v c="$1" '{ v[NR] = $c } END { print v[int((NR + 1) / 2)] }'
}

measure() { # measure CMD... -> "seconds KiB", the medians of REPS runs
  local i out=$dir/map-bench.runs
  : > "$out"
  for ((i = 0; i < REPS; i++)); do
    /usr/bin/time -f "%e %M" -a -o "$out" "$@" > /dev/null
  done
  echo "$(median 1 < "$out") $(median 2 < "$out")"
}

row() { # row N WHAT ARGS...
  local n=$1 what=$2; shift 2
  local r q
  r=$(measure "$RAWDISK_BIN" map --output json "$@" "$img")
  q=$(measure qemu-img map --output=json -f raw "$@" "$img")
  awk -v n="$n" -v w="$what" -v r="$r" -v q="$q" 'BEGIN {
    split(r, a, " "); split(q, b, " ")
    printf "| %s | %s | %s s / %.1f MiB | %s s / %.1f MiB |\n", n, w, a[1], a[2] / 1024, b[1], b[2] / 1024 }'
}

echo "| data extents | map | rawdisk: time / peak RSS | qemu-img: time / peak RSS |"
echo "|---|---|---|---|"
for n in "$@"; do
  make_file "$n"
  row "$n" whole
  row "$n" "64 MiB in the middle" --start-offset $((n * 4096)) --max-length 64M
done
rm -f "$dir/map-bench.runs"
