#!/bin/bash
# bench/nfs-seed.sh -- the seed's benchmark on the testkit's NFS-like file
# system (nfs-like-fs, profiles nfs3 and nfs42, 200 us per operation):
# rawdisk serve beside nbdkit file, qemu-nbd writeback+unmap and qemu-nbd
# none+native (O_DIRECT) serving a file on the mount, the servers
# interleaved in each repetition. Rows:
#   convert  qemu-img convert -n of a 2 GiB sparse image (a few hundred MiB
#            of random data at scattered offsets) into the served file, fresh
#            (sparse) or dirty (full of other data), with and without -W;
#   create   rawdisk create --preallocation falloc beside qemu-img create -f
#            raw -o preallocation=falloc, straight on the mount;
#   zero     1 GiB of data zeroed through libnbd (aio_zero in 64 MiB or 2 MiB
#            requests, with or without NO_HOLE, then flush).
# The file system's counts (.nfs-like-stats) are read before and after each
# run; the server's CPU (utime+stime) just before it is stopped. Every run is
# checked: the converted file equals the source, the zeroed file reads as
# zeros, the created file has its size. Prints markdown tables: median
# seconds [min-max], ratio of medians to the best anchor, server CPU median,
# and the counts (median; "a-b" where repetitions differed). Not a test.
#
# Usage (root): bench/nfs-seed.sh [REPS]       (default 5)
#   RAWDISK_BIN, NFS_LIKE_BIN   binaries (default target/release/..., built)
#   PROFILES="nfs3 nfs42"  ROWS="convert create zero"  LATENCY_US=200
#   SERVERS="rawdisk nbdkit qemu-nbd qemu-nbd-direct"
#   CREATE_SIZES="1G"  ZERO_CHUNKS="64M 2M"
#   CREATE_REPS (default REPS): qemu-img's falloc on nfs3 is glibc's
#   posix_fallocate emulation, one 1-byte write per 4 KiB (80 s per GiB at
#   200 us), so fewer repetitions of that row keep the run short.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH="/usr/sbin:/usr/bin:/sbin:/bin:$HOME/.cargo/bin:$PATH"
[ "$(id -u)" = 0 ] || { echo "nfs-seed.sh: needs root (mounts)" >&2; exit 2; }
reps=${1:-5}
profiles=${PROFILES:-nfs3 nfs42}
rows=${ROWS:-convert create zero}
servers=${SERVERS:-rawdisk nbdkit qemu-nbd qemu-nbd-direct}
latency=${LATENCY_US:-200}
create_sizes=${CREATE_SIZES:-1G}
zero_chunks=${ZERO_CHUNKS:-64M 2M}
tgt=${CARGO_TARGET_DIR:-$PWD/target}
if [ -z "${RAWDISK_BIN:-}" ]; then
    cargo build --release -q -p rawdisk
    RAWDISK_BIN=$tgt/release/rawdisk
fi
if [ -z "${NFS_LIKE_BIN:-}" ]; then
    cargo build --release -q -p rawdisk-testkit --bins
    NFS_LIKE_BIN=$tgt/release/nfs-like-fs
fi
py=/usr/bin/python3 # the one with libnbd's bindings

work=$(mktemp -d /tmp/nfs-seed.XXXXXX)
mount -t tmpfs -o size=9G tmpfs "$work"
mkdir "$work/back" "$work/mnt"
mnt=$work/mnt
sock=$work/s.sock
pid= fspid=
cleanup() {
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    if [ -n "$fspid" ]; then
        umount "$mnt" 2>/dev/null || umount -l "$mnt"
        wait "$fspid" 2>/dev/null
    fi
    umount "$work" && rmdir "$work"
}
trap cleanup EXIT
die() {
    echo "nfs-seed.sh: $*" >&2
    [ -n "$pid" ] && kill "$pid" 2>/dev/null
    exit 1
}

gib=$((1 << 30))
src=$work/src.img
other=$work/other.img
# The seed's image: 2 GiB, ~340 MiB of random data in 160 extents of
# 256 KiB-4 MiB at scattered 64 KiB-aligned offsets (fixed seed).
$py - "$src" <<'EOF'
import os, random, sys
r = random.Random(38)
with open(sys.argv[1], "wb") as f:
    f.truncate(2 << 30)
    for _ in range(160):
        n = r.randrange(4, 65) << 16
        off = r.randrange(0, ((2 << 30) - n) >> 16) << 16
        f.seek(off)
        f.write(os.urandom(n))
EOF
head -c $((2 * gib)) /dev/urandom >"$other"

stats() { cat "$mnt/.nfs-like-stats"; }
# Counts after minus before: "ops writes MiB-written alloc punch refused
# seeks fsyncs other" (other: getattr, open, flush, reads... the rest).
delta() {
    $py -c '
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
d = {k: b[k] - a[k] for k in a}
named = ["writes", "fallocate_alloc", "fallocate_punch", "fallocate_refused", "lseek", "fsync"]
mib = d["write_bytes"] / 2**20
print(d["ops"], d["writes"], "%.0f" % mib if mib >= 10 or mib == 0 else "%.2f" % mib,
      *(d[k] for k in named[1:]), d["ops"] - sum(d[k] for k in named))' "$1" "$2"
}

cpu_of() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.2f", ($14 + $15) / hz }' "/proc/$1/stat"; }

mount_fs() { # profile
    : >"$work/fs.out"
    "$NFS_LIKE_BIN" --profile "$1" --latency-us "$latency" "$work/back" "$mnt" >"$work/fs.out" &
    fspid=$!
    for _ in $(seq 200); do grep -q ready "$work/fs.out" && return; sleep 0.025; done
    die "nfs-like-fs $1 did not mount"
}
umount_fs() {
    umount "$mnt"
    wait "$fspid" || true
    fspid=
}

. bench/servers.sh
start() { serve "$1" "$2" "$sock" || die "$1 did not start"; }
stop() { # -> prints the server's CPU seconds
    cpu_of "$pid"
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    pid=
}

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }'; }

# The destination through the mount, as the row starts from.
prepare() { # file size fresh|dirty
    rm -f "$1"
    if [ "$3" = dirty ]; then
        dd if="$other" of="$1" bs=4M count=$(($2 >> 22)) conv=fsync status=none
    else
        truncate -s "$2" "$1"
    fi
}

# One run of a row for a tool; prints "seconds cpu" and the counts.
run_convert() { # server fresh|dirty W|-
    local f=$mnt/d.img t0 b cpu
    prepare "$f" $((2 * gib)) "$2"
    start "$1" "$f"
    b=$(stats)
    t0=$(now)
    qemu-img convert -n -f raw -O raw $([ "$3" = W ] && echo -W) "$src" "nbd+unix:///?socket=$sock" ||
        die "$1: convert failed"
    local s; s=$(elapsed "$t0")
    cpu=$(stop)
    echo "$s $cpu $(delta "$b" "$(stats)")"
    cmp -s "$src" "$work/back/d.img" || die "$1 $2 $3: destination differs from the source"
}

run_create() { # tool size
    local f=$mnt/c.img t0 b s
    rm -f "$f"
    b=$(stats)
    t0=$(now)
    case $1 in
    rawdisk) "$RAWDISK_BIN" create --preallocation falloc "$f" "$2" >/dev/null ;;
    qemu-img) qemu-img create -q -f raw -o preallocation=falloc "$f" "$2" ;;
    esac
    s=$(elapsed "$t0")
    echo "$s - $(delta "$b" "$(stats)")"
    [ "$(stat -c %s "$work/back/c.img")" = "$(numfmt --from=iec "$2")" ] || die "$1 create $2: wrong size"
    rm -f "$f"
}

run_zero() { # server chunk nohole|trim
    local f=$mnt/z.img t0 b s cpu out chunk depth=8
    chunk=$(numfmt --from=iec "$2")
    [ "$chunk" -ge $((32 << 20)) ] && depth=1
    prepare "$f" "$gib" dirty
    start "$1" "$f"
    b=$(stats)
    t0=$(now)
    out=$($py bench/nbd-zeroes.py "nbd+unix:///?socket=$sock" "$chunk" "$depth" "$3")
    s=$(elapsed "$t0")
    cpu=$(stop)
    [ "${out#* }" = ok ] || die "$1 zero $2 $3: $out"
    echo "$s $cpu $(delta "$b" "$(stats)")"
    cmp -s -n "$gib" "$work/back/z.img" /dev/zero || die "$1 zero $2 $3: data left"
}

median() { # numbers on stdin -> "median [min-max]" (or the value alone when equal)
    sort -g | awk -v fmt="${1:-}" '{ v[NR] = $1 } END {
        m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
        if (fmt == "count") { if (v[1] == v[NR]) printf "%s", v[1]; else printf "%s (%s-%s)", m, v[1], v[NR] }
        else printf "%.2f [%.2f-%.2f]", m, v[1], v[NR] }'
}
med() { sort -g | awk '{ v[NR] = $1 } END { if (!NR) print "-"; else print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# Runs one row configuration: "fn args..." for each tool interleaved, then
# prints its table lines. $1 profile, $2 label, $3 tools, $4 fn, rest args.
row() {
    local prof=$1 label=$2 tools=$3 fn=$4 r s best= n=$reps
    shift 4
    [ "$fn" = run_create ] && n=${CREATE_REPS:-$reps}
    declare -A res=()
    for _ in $(seq "$n"); do
        for s in $tools; do
            r=$("$fn" "$s" "$@")
            res[$s]+="$r"$'\n'
        done
    done
    for s in $tools; do
        [ "$s" = rawdisk ] && continue
        m=$(printf %s "${res[$s]}" | awk 'NF { print $1 }' | med)
        if [ -z "$best" ] || awk -v a="$m" -v b="$best" 'BEGIN { exit !(a < b) }'; then best=$m; fi
    done
    for s in $tools; do
        col() { printf %s "${res[$s]}" | awk -v c="$1" 'NF { print $c }'; }
        m=$(col 1 | med)
        cpu=$(col 2 | grep -v '^-$' | med || true)
        printf '| %s | %s | %s | %s | %.2f | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' \
            "$prof" "$label" "$s" "$(col 1 | median)" "$(awk -v a="$m" -v b="$best" 'BEGIN { print a / b }')" \
            "${cpu:--}" "$(col 3 | median count)" "$(col 4 | median count)" "$(col 5 | median count)" \
            "$(col 6 | median count)" "$(col 7 | median count)" "$(col 8 | median count)" \
            "$(col 9 | median count)" "$(col 10 | median count)" "$(col 11 | median count)"
    done
}

echo "<!-- bench/nfs-seed.sh $reps; latency ${latency} us; $(uname -r); $(nproc) cpus; $(nbdkit --version 2>/dev/null | head -1); $(qemu-nbd --version | head -1); load at start $(cut -d' ' -f1-3 /proc/loadavg) -->"
echo
echo "| fs | row | tool | seconds median [min-max] | / best anchor | server CPU s | ops | writes | MiB written | ALLOCATE | DEALLOCATE | refused | SEEK | fsync | other |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for prof in $profiles; do
    mount_fs "$prof"
    for rw in $rows; do
        case $rw in
        convert)
            for st in fresh dirty; do
                for w in - W; do
                    row "$prof" "convert $st$([ $w = W ] && echo ' -W')" "$servers" run_convert "$st" "$w"
                done
            done ;;
        create)
            for sz in $create_sizes; do
                row "$prof" "create falloc $sz" "rawdisk qemu-img" run_create "$sz"
            done ;;
        zero)
            for ch in $zero_chunks; do
                for fl in trim nohole; do
                    row "$prof" "zero 1G dirty, $ch$([ $fl = nohole ] && echo ' NO_HOLE')" "$servers" run_zero "$ch" "$fl"
                done
            done ;;
        *) die "unknown row $rw" ;;
        esac
    done
    umount_fs
done
echo
echo "<!-- load at end $(cut -d' ' -f1-3 /proc/loadavg) -->"
