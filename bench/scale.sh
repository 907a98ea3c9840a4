#!/bin/bash
# bench/scale.sh -- how time and memory grow with the work (docs/benchmarks.md,
# Scale): sparse files of 1 GiB / 1 TiB / 64 TiB with ten 4 KiB data extents,
# files with N data extents (one 4 KiB block in every 8 KiB), connections
# idle after the handshake, and exports of `serve --dir`. Not a test: prints
# the tables, each time the median of REPS runs, peak RSS from GNU time (or
# the server's VmHWM / RssAnon from /proc).
#
# Usage: bench/scale.sh DIR [ROW]...
#   DIR  a directory on a file system that holds 64 TiB sparse files (tmpfs,
#        XFS; not ext4); the files are removed afterwards
#   ROW  size, extents, connections, exports (default: all)
# Environment: RAWDISK_BIN (default target/release/rawdisk), REPS (3),
#   SIZES ("1G 1T 64T"), EXTENTS ("1000 100000 1000000": N data blocks take
#   N * 4 KiB, twice for the copy), CONNS ("1 100 1000"), EXPORTS ("1 10000")
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
: "${RAWDISK_BIN:=$HERE/../target/release/rawdisk}" "${REPS:=3}"
: "${SIZES:=1G 1T 64T}" "${EXTENTS:=1000 100000 1000000}"
: "${CONNS:=1 100 1000}" "${EXPORTS:=1 10000}"
[[ $# -ge 1 ]] || { echo "usage: bench/scale.sh DIR [ROW]..." >&2; exit 2; }
dir=$(cd "$1" && pwd); shift
[[ $# -gt 0 ]] || set -- size extents connections exports
work=$(mktemp -d "$dir/scale-bench.XXXXXX")
server=
cleanup() {
  [[ -z $server ]] || kill "$server" 2> /dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
ulimit -n 8192

median() { # median COLUMN < lines of numbers
  sort -n -k"$1" | awk -v c="$1" '{ v[NR] = $c } END { print v[int((NR + 1) / 2)] }'
}

measure() { # measure CMD... -> "seconds MiB": medians of REPS runs
  local i out=$work/runs
  : > "$out"
  for ((i = 0; i < REPS; i++)); do
    /usr/bin/time -f "%e %M" -a -o "$out" "$@" > /dev/null
  done
  echo "$(median 1 < "$out") $(median 2 < "$out" | awk '{ printf "%.1f", $1 / 1024 }')"
}

sparse() { # sparse PATH SIZE DATA: DATA 4 KiB blocks spread evenly
  /usr/bin/python3 - "$@" <<'EOF'
import os, sys
path, size, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
os.ftruncate(fd, size)
for i in range(n):
    os.pwrite(fd, b"x" * 4096, i * (size // n) // 4096 * 4096)
os.close(fd)
EOF
}

status() { # status PID FIELD -> KiB
  awk -v f="$2:" '$1 == f { print $2 }' "/proc/$1/status"
}

serve() { # serve ARGS...: starts the server on $work/sock
  rm -f "$work/sock"
  "$RAWDISK_BIN" serve -U "$work/sock" "$@" > /dev/null 2>&1 &
  server=$!
  local i
  for ((i = 0; i < 100; i++)); do [[ -S $work/sock ]] && return; sleep 0.05; done
  echo "server did not start" >&2; exit 1
}

stop() {
  kill "$server"; wait "$server" 2> /dev/null || true; server=
}

served_map() { # served_map FILE -> "seconds MiB": nbdinfo --map, server's VmHWM
  serve -r "$1"
  local t
  t=$(measure nbdinfo --map "nbd+unix:///?socket=$work/sock")
  echo "${t% *} $(status "$server" VmHWM | awk '{ printf "%.1f", $1 / 1024 }')"
  stop
}

row() { # row LABEL FILE: copy, compare, checksum, served map of FILE
  local f=$2 c m s n
  c=$(measure "$RAWDISK_BIN" copy "$f" "$work/copy.img")
  m=$(measure "$RAWDISK_BIN" compare "$f" "$work/copy.img")
  s=$(measure "$RAWDISK_BIN" checksum "$f")
  n=$(served_map "$f")
  rm -f "$work/copy.img"
  echo "| $1 | ${c% *} s / ${c#* } MiB | ${m% *} s / ${m#* } MiB | ${s% *} s / ${s#* } MiB | ${n% *} s / ${n#* } MiB |"
}

header() {
  echo
  echo "| $1 | copy | compare | checksum | serve + nbdinfo --map |"
  echo "|---|---|---|---|---|"
}

bytes() { numfmt --from=iec "$1"; }

rows_size() {
  header "size (10 data extents)"
  local s
  for s in $SIZES; do
    sparse "$work/src.img" "$(bytes "$s")" 10
    row "$s" "$work/src.img"
  done
  rm -f "$work/src.img"
}

rows_extents() {
  header "data extents"
  local n
  for n in $EXTENTS; do
    sparse "$work/src.img" $((n * 8192)) "$n"
    row "$n" "$work/src.img"
  done
  rm -f "$work/src.img"
}

rows_connections() {
  echo
  echo "| connections idle after the handshake | server RssAnon | per connection | after all closed |"
  echo "|---|---|---|---|"
  truncate -s 1G "$work/conn.img"
  local n
  for n in $CONNS; do
    serve --max-connections $((n + 10)) "$work/conn.img"
    /usr/bin/python3 - "$work/sock" "$n" "$server" <<'EOF'
import socket, struct, sys, time
path, n, pid = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def rss():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
def recv(s, n):
    b = b""
    while len(b) < n:
        got = s.recv(n - len(b))
        assert got, "closed"
        b += got
    return b
def connect():
    # Fixed newstyle, NBD_OPT_GO of the default export, then nothing.
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    recv(s, 18)
    s.sendall(struct.pack(">I", 3))
    s.sendall(struct.pack(">QII", 0x49484156454F5054, 7, 6) + struct.pack(">IH", 0, 0))
    while True:
        _, _, typ, ln = struct.unpack(">QIII", recv(s, 20))
        recv(s, ln)
        if typ == 1:
            return s
        assert typ == 3, hex(typ)
time.sleep(1)
base = rss()
conns = [connect() for _ in range(n)]
time.sleep(2.5)  # buffers of connections quiet for a second are let go
idle = rss()
for s in conns:
    s.close()
time.sleep(2)
print(f"| {n} | {idle / 1024:.1f} MiB | {(idle - base) / n:.1f} KiB | "
      f"{rss() / 1024:.1f} MiB (start {base / 1024:.1f}) |")
EOF
    stop
  done
  rm -f "$work/conn.img"
}

rows_exports() {
  echo
  echo "| exports (serve --dir) | nbdinfo --list: time | server peak RSS |"
  echo "|---|---|---|"
  local n i t
  for n in $EXPORTS; do
    mkdir -p "$work/exports"
    for ((i = 0; i < n; i++)); do : > "$work/exports/e$i.img"; done
    truncate -s 1M "$work/exports"/*.img
    serve -r --dir "$work/exports"
    t=$(measure nbdinfo --list "nbd+unix:///?socket=$work/sock")
    echo "| $n | ${t% *} s | $(status "$server" VmHWM | awk '{ printf "%.1f", $1 / 1024 }') MiB |"
    stop
    rm -rf "$work/exports"
  done
}

for r in "$@"; do "rows_$r"; done
