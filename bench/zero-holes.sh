#!/bin/bash
# bench/zero-holes.sh -- NBD_CMD_WRITE_ZEROES with NO_HOLE (zeros that keep
# their space) over a whole 1 GiB export, through rawdisk serve, nbdkit file
# and qemu-nbd (writeback, discard=unmap) side by side, the servers
# interleaved in each repetition. Two starting points: a fresh sparse image
# (all holes) and one full of data; two request shapes: 2 MiB requests 8 in
# flight (what a guest's blkdiscard -z sends) and 32 MiB in order.
# Prints a markdown table: median seconds [min-max], the ratio of medians to
# the best anchor, and the server's CPU (utime+stime) per run; every run's
# image is checked to read as zeros and to stay allocated. Not a test.
#
# Usage (root): bench/zero-holes.sh [REPS]     (default 5)
#   FS=tmpfs|ext4|xfs|loop   where the image lives (default tmpfs): a file on
#       tmpfs; a file on ext4 or XFS made on a loop device over a tmpfs file;
#       or the loop device itself over a tmpfs file, attached afresh per run.
#   RAWDISK_BIN=path   the binary (default target/release/rawdisk, built)
#   SERVERS="rawdisk nbdkit qemu-nbd"   a subset; "custom:NAME" runs the
#   binary in RAWDISK_BIN_NAME (a build to compare against).
#   SIZE=1   the export in GiB; STARTS="holes data" a subset. A bigger
#       export over holes (SIZE=16 STARTS=holes) makes the per-request
#       cost of in-order zeros visible; data needs SIZE GiB of RAM.
#   SHAPES="2097152 8,33554432 1"   request bytes and depth, comma-separated
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH="/usr/sbin:/usr/bin:/sbin:/bin:$HOME/.cargo/bin:$PATH"
[ "$(id -u)" = 0 ] || { echo "zero-holes.sh: needs root (mount, losetup)" >&2; exit 2; }
reps=${1:-5}
fs=${FS:-tmpfs}
case $fs in tmpfs | ext4 | xfs | loop) ;; *) echo "zero-holes.sh: FS=$fs: tmpfs, ext4, xfs or loop" >&2; exit 2 ;; esac
servers=${SERVERS:-rawdisk nbdkit qemu-nbd}
if [ -z "${RAWDISK_BIN:-}" ]; then
    cargo build --release -q -p rawdisk
    RAWDISK_BIN=$PWD/target/release/rawdisk
fi
work=$(mktemp -d /tmp/zero-holes.XXXXXX)
mount -t tmpfs -o size=3G tmpfs "$work"
pid= fsdev= dev=
cleanup() {
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    [ -n "$dev" ] && losetup -d "$dev"
    [ -n "$fsdev" ] && { umount "$work/mnt"; losetup -d "$fsdev"; }
    umount "$work" && rmdir "$work"
}
trap cleanup EXIT
size=$((${SIZE:-1} << 30))
sock=$work/s.sock
img=$work/d.img
case $fs in
ext4 | xfs)
    truncate -s $((size / 1048576 + 600))M "$work/fs.img"
    fsdev=$(losetup -f --show "$work/fs.img")
    if [ "$fs" = ext4 ]; then mkfs.ext4 -q -F "$fsdev"; else mkfs.xfs -q -f "$fsdev"; fi
    mkdir "$work/mnt"
    mount "$fsdev" "$work/mnt"
    img=$work/mnt/d.img
    ;;
esac
back=$img # the file whose allocation is checked

. bench/servers.sh

cpu_of() { # utime+stime of a pid, seconds
    awk -v hz="$(getconf CLK_TCK)" '{ printf "%.3f", ($14 + $15) / hz }' "/proc/$1/stat"
}

one() { # server start chunk depth -> "seconds cpu"
    rm -f "$back"
    truncate -s "$size" "$back"
    if [ "$2" = data ]; then
        dd if=/dev/urandom of="$back" bs=4M count=$((size >> 22)) conv=notrunc,fsync status=none
    fi
    served=$back
    if [ "$fs" = loop ]; then
        dev=$(losetup -f --show "$back")
        served=$dev
    fi
    serve "$1" "$served" "$sock" || exit 1
    out=$(python3 bench/nbd-zeroes.py "nbd+unix:///?socket=$sock" "$3" "$4" nohole)
    cpu=$(cpu_of "$pid")
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    pid=
    case $out in *" ok") ;; *) echo "zero-holes.sh: $1: $out" >&2; exit 1 ;; esac
    cmp -s -n "$size" "$served" /dev/zero || { echo "zero-holes.sh: $1 left data" >&2; exit 1; }
    if [ -n "$dev" ]; then
        losetup -d "$dev"
        dev=
    fi
    alloc=$(($(stat -c %b "$back") * 512))
    [ "$alloc" -ge $((size - (1 << 20))) ] || {
        echo "zero-holes.sh: $1 freed space under NO_HOLE ($alloc bytes allocated)" >&2
        exit 1
    }
    echo "${out%% *} $cpu"
}

stats() { # numbers on stdin -> "median [min-max]"
    sort -g | awk '{ v[NR] = $1 } END {
        m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
        printf "%.4f [%.4f-%.4f]", m, v[1], v[NR] }'
}

echo "<!-- FS=$fs bench/zero-holes.sh $reps; $(uname -r); $(nproc) cpus; load $(cut -d' ' -f1-3 /proc/loadavg); $(nbdkit --version 2>/dev/null | head -1); $(qemu-nbd --version | head -1) -->"
echo
echo "| storage | start | requests | server | seconds median [min-max] | / best anchor | server CPU s median |"
echo "|---|---|---|---|---|---|---|"
for start_as in ${STARTS:-holes data}; do
    IFS=, read -ra shapes <<<"${SHAPES:-2097152 8,33554432 1}"
    for shape in "${shapes[@]}"; do
        set -- $shape
        declare -A t=() c=()
        for _ in $(seq "$reps"); do
            for s in $servers; do
                r=$(one "$s" "$start_as" "$1" "$2")
                t[$s]+="${r% *}"$'\n'
                c[$s]+="${r#* }"$'\n'
            done
        done
        best=
        for s in $servers; do
            case $s in rawdisk | custom:*) continue ;; esac
            m=$(printf '%s' "${t[$s]}" | stats | cut -d' ' -f1)
            if [ -z "$best" ] || awk -v a="$m" -v b="$best" 'BEGIN { exit !(a < b) }'; then best=$m; fi
        done
        for s in $servers; do
            ts=$(printf '%s' "${t[$s]}" | stats)
            m=${ts%% *}
            ratio=$(awk -v a="$m" -v b="${best:-0}" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }')
            cs=$(printf '%s' "${c[$s]}" | stats | cut -d' ' -f1)
            echo "| $fs | $start_as | $(($1 >> 20)) MiB x$2 | $s | $ts | $ratio | $cs |"
        done
        unset t c
    done
done
echo "<!-- load at the end: $(cut -d' ' -f1-3 /proc/loadavg) -->"
