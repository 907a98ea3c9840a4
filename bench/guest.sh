#!/bin/bash
# bench/guest.sh -- a Linux guest (qemu-system-x86_64, virtio-blk) on an
# export served by rawdisk serve, nbdkit file and qemu-nbd (writeback,
# discard=unmap), the servers interleaved in each repetition, one boot per
# server and repetition on a fresh sparse image on tmpfs. The guest is
# Debian's kernel package and an initramfs built from Debian packages
# (busybox-static, fio, e2fsprogs, util-linux; apt-get download + dpkg-deb -x
# into GUEST_CACHE, nothing installed but qemu-system-x86). Its /init
# (bench/guest-init.sh) runs, in order: mkfs.ext4 -E discard; fstrim after
# 256 MiB written and deleted; fio 1 MiB sequential write then read of the
# whole export and 4 KiB random write then read, qd16, libaio, O_DIRECT;
# blkdiscard -z. KVM when a guest boots under it (probed), TCG otherwise.
# The host samples the server's CPU (utime+stime) and resets its peak RSS
# (clear_refs 5) when the guest announces a workload, reads both when it
# ends. After each boot the image must read as zeros. Prints markdown:
# median [min-max] per workload and server, ratio of rawdisk's median to the
# best anchor's (seconds: lower is better; MiB/s, IOPS: higher), server CPU
# and peak RSS medians; then what the guest's queue limits were per server,
# and how busy the guest's vCPU was and how many virtio interrupts it took
# a request.
# Not a test.
#
# Usage (root): bench/guest.sh [REPS]        (default 3; 0 with TRACE=1:
#                                              only the traced boots)
#   RAWDISK_BIN=path   the binary (default release build, built)
#   SERVERS="rawdisk nbdkit qemu-nbd"   also rawdisk-direct (--cache none),
#       qemu-nbd-direct (--cache=none --aio=native): compare those two only;
#       nbdkit-memory, a ceiling (RAM, no file), is never the best anchor
#   SIZE=1G  RUNTIME=10 (random fio, s)  ACCEL=auto|kvm|tcg
#   TRACE=1  one more boot per server with qemu's nbd_send_request trace:
#       a table of the NBD requests qemu sent per workload (type, count,
#       smallest-largest length); not timed
#   SCHED=1  also count each workload's context switches and CPU migrations
#       of the server (perf stat -p) and of qemu-system-x86_64: a table of
#       medians per second of the workload
#   QUIET=s  a boot whose console says nothing for this long is stopped and
#       reported (default RUNTIME + 110), with the requests rawdisk says it
#       has read and not answered (SIGUSR1's "unanswered")
#   NBDTRACE=1  trace qemu's NBD requests and replies on every boot: a boot
#       that does not finish names the requests the server did not answer
#   GUEST_CACHE=dir    downloaded packages and the built initramfs
#       (default ${TMPDIR:-/tmp}/rawdisk-guest-cache)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH="/usr/sbin:/usr/bin:/sbin:/bin:$HOME/.cargo/bin:$PATH"
[ "$(id -u)" = 0 ] || { echo "guest.sh: needs root (mount, apt-get)" >&2; exit 2; }
reps=${1:-3}
servers=${SERVERS:-rawdisk nbdkit qemu-nbd}
size=${SIZE:-1G}
runtime=${RUNTIME:-10}
accel=${ACCEL:-auto}
trace=${TRACE:-0}
sched=${SCHED:-0}
quiet=${QUIET:-$((runtime + 110))}
nbdtrace=${NBDTRACE:-0}
cache=${GUEST_CACHE:-${TMPDIR:-/tmp}/rawdisk-guest-cache}
tgt=${CARGO_TARGET_DIR:-$PWD/target}
die() { echo "guest.sh: $*" >&2; exit 1; }
# read -t 0 only polls: every boot would be stopped as silent at once.
[[ $quiet =~ ^[1-9][0-9]*$ ]] || die "QUIET must be a whole number of seconds above 0, not '$quiet'"
if [ -z "${RAWDISK_BIN:-}" ]; then
    cargo build --release -q -p rawdisk
    RAWDISK_BIN=$tgt/release/rawdisk
fi
# The backports archive in apt's sources, from the mirror the system
# already uses: a machine can carry a backported qemu-utils without it.
backports_source() {
    local suite=$1 mirror
    apt-cache policy | grep -q " $suite/" && return 0
    mirror=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources 2>/dev/null)
    [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && $2 ~ /^http/ { print $2; exit }' /etc/apt/sources.list 2>/dev/null)
    mirror=${mirror:-http://deb.debian.org/debian}
    echo "guest.sh: qemu-utils is from $suite; adding it to apt's sources ($mirror)" >&2
    echo "deb $mirror $suite main" >/etc/apt/sources.list.d/rawdisk-bench-backports.list
    apt-get update -q >/dev/null || die "apt-get update after adding $suite failed"
}
# qemu-system-x86 at qemu-utils' version: apt would otherwise swap the
# installed qemu-nbd for another version's; --no-remove keeps it from that.
# A backported qemu-utils needs its dependencies from backports too (-t).
if ! command -v qemu-system-x86_64 >/dev/null; then
    v=$(dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null || true)
    from=()
    case $v in *bpo*)
        suite="$(. /etc/os-release && echo "$VERSION_CODENAME")-backports"
        backports_source "$suite"
        from=(-t "$suite")
        ;;
    esac
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends --no-remove \
        "${from[@]}" "qemu-system-x86${v:+=$v}" >/dev/null ||
        die "apt-get install ${from[*]} qemu-system-x86${v:+=$v} failed"
fi

# The guest: kernel and initramfs, rebuilt when the init script changes.
build_guest() {
    local kpkg root=$cache/root ir=$cache/initramfs ld libdirs
    kpkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
    [ -n "$kpkg" ] || die "no linux-image package behind linux-image-amd64"
    # fio's, mke2fs', blkdiscard's and fstrim's libraries: the library packages
    # of their dependency closure; only what the loader lists is copied.
    local libs
    libs=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
        --no-replaces --no-enhances fio e2fsprogs util-linux |
        grep -E '^(lib[a-z0-9.+-]+|zlib1g)$' | grep -vE -- '-perl$|^libperl|^libpython|^libelogind' | sort -u)
    rm -rf "$root" "$ir" "$cache/debs"
    mkdir -p "$cache/debs" "$root" "$ir"
    # shellcheck disable=SC2086
    (cd "$cache/debs" && apt-get download -q "$kpkg" busybox-static fio e2fsprogs util-linux $libs >/dev/null 2>&1) ||
        die "apt-get download failed"
    for d in "$cache"/debs/*.deb; do dpkg-deb -x "$d" "$root"; done
    local kver
    kver=$(basename "$root"/lib/modules/*)
    cp "$root/boot/vmlinuz-$kver" "$cache/vmlinuz"
    mkdir -p "$ir"/{bin,sbin,usr/bin,usr/sbin,usr/local/sbin,lib/x86_64-linux-gnu,lib64,lib/modules,etc}
    cp "$root/bin/busybox" "$ir/bin/"
    ln -s busybox "$ir/bin/sh"
    cp "$root/usr/bin/fio" "$root/sbin/mke2fs" "$root/sbin/blkdiscard" "$root/sbin/fstrim" "$ir/usr/local/sbin/"
    ln -s mke2fs "$ir/usr/local/sbin/mkfs.ext4"
    cp "$root/etc/mke2fs.conf" "$ir/etc/"
    ld=$root/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
    # librados finds libceph-common through its RUNPATH: every dir with a library
    libdirs=$(find "$root"/lib/x86_64-linux-gnu "$root"/usr/lib/x86_64-linux-gnu -name '*.so*' -printf '%h\n' |
        sort -u | paste -sd:)
    cp -L "$ld" "$ir/lib/x86_64-linux-gnu/"
    ln -s ../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 "$ir/lib64/"
    for b in "$ir"/usr/local/sbin/{fio,mke2fs,blkdiscard,fstrim}; do
        "$ld" --list --library-path "$libdirs" "$b" >"$cache/ldd.out" 2>&1 || die "loader: $b: $(cat "$cache/ldd.out")"
        ! grep -q 'not found' "$cache/ldd.out" || die "$b: $(grep 'not found' "$cache/ldd.out")"
        awk '$2 == "=>" { print $3 }' "$cache/ldd.out" | while read -r l; do
            cp -L "$l" "$ir/lib/x86_64-linux-gnu/"
        done
    done
    # Debian builds these as modules (CONFIG_VIRTIO_BLK=m, VIRTIO_PCI=m,
    # EXT4_FS=m); ext4 asks the crypto API for crc32c when mounting.
    : >"$ir/modules.list"
    add_mod() {
        local f
        grep -qx "$1" "$ir/modules.list" && return
        f=$(find "$root/lib/modules/$kver" -name "$1.ko" | head -1)
        [ -n "$f" ] || die "module $1 not in $kpkg"
        for d in $(strings -a "$f" | sed -n 's/^depends=//p' | tr , ' '); do add_mod "$d"; done
        cp "$f" "$ir/lib/modules/"
        echo "$1" >>"$ir/modules.list"
    }
    for m in virtio_pci virtio_blk crc32c_generic ext4; do add_mod "$m"; done
    cp bench/guest-init.sh "$ir/init"
    chmod 755 "$ir/init"
    (cd "$ir" && find . | "$root/bin/busybox" cpio -o -H newc 2>/dev/null | gzip -1) >"$cache/initrd.gz"
    echo "$kpkg $(dpkg-deb -f "$cache"/debs/"$kpkg"_*.deb Version)" >"$cache/kernel"
    sha256sum bench/guest-init.sh >"$cache/stamp"
}
mkdir -p "$cache"
sha256sum --status -c "$cache/stamp" 2>/dev/null && [ -s "$cache/initrd.gz" ] || build_guest

work=$(mktemp -d /tmp/guest.XXXXXX)
export SERVER_LOG=$work/server.log
mount -t tmpfs -o size=3G tmpfs "$work"
pid= qpid=
cleanup() {
    [ -n "$qpid" ] && kill "$qpid" 2>/dev/null
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    umount "$work" && rmdir "$work"
}
trap cleanup EXIT
sock=$work/s.sock
img=$work/d.img
res=$work/results

# qemu-system-x86_64 arguments for a boot: accel mode -> sets qa
qargs() {
    qa=(-accel "$1" -m 1024 -smp 1 -cpu max -display none -monitor none -serial stdio -no-reboot
        -kernel "$cache/vmlinuz" -initrd "$cache/initrd.gz"
        -append "console=ttyS0 quiet loglevel=3 panic=-1 rdguest.mode=$2 rdguest.runtime=$runtime")
}
# KVM when the probe guest reaches init in time (/dev/kvm may exist and
# still not boot a stock kernel); TCG otherwise.
why=
if [ "$accel" = auto ]; then
    accel=tcg
    if [ -c /dev/kvm ]; then
        qargs kvm probe
        # "|| true" inside: the subshell, not this shell, reports a qemu
        # killed by a signal (KVM here can abort on an MSR), into /dev/null.
        (timeout 60 qemu-system-x86_64 "${qa[@]}" </dev/null >"$work/probe" 2>&1 || true) 2>/dev/null
        if grep -q '^@@ up' "$work/probe"; then
            accel=kvm
        else
            why=" (kvm: no init within 60 s: $(tr -d '\r' <"$work/probe" | grep -m1 . | cut -c1-80 || true))"
        fi
    else
        why=" (no /dev/kvm)"
    fi
fi

cpu_of() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.3f", ($14 + $15) / hz }' "/proc/$1/stat"; }
hwm_of() { awk '/^VmHWM/ { printf "%.1f", $2 / 1024 }' "/proc/$1/status"; }

. bench/servers.sh

# NBD requests in qemu's trace lines FROM+1..TO of FILE, by type and flags:
# "type flags count [smallest-largest]".
requests() { # file from to
    sed -n "$(($2 + 1)),$3p" "$1" | awk '
        function h(b) {
            if (b >= 1048576 && b % 1048576 == 0) return b / 1048576 "M"
            if (b >= 1024 && b % 1024 == 0) return b / 1024 "K"
            return b
        }
        match($0, /\.len = [0-9]+/) {
            n = substr($0, RSTART + 7, RLENGTH - 7) + 0
            match($0, /\.flags = 0x[0-9a-f]+/); fl = substr($0, RSTART + 9, RLENGTH - 9)
            match($0, /\([a-z ]+\) }/); t = substr($0, RSTART + 1, RLENGTH - 4) (fl == "0x0" ? "" : " " fl)
            if (!(t in c)) { lo[t] = n; hi[t] = n; order[++k] = t }
            c[t]++
            if (n < lo[t]) lo[t] = n
            if (n > hi[t]) hi[t] = n
        }
        END {
            for (i = 1; i <= k; i++) {
                t = order[i]
                printf "%s%s %d [%s-%s]", (i > 1 ? ", " : ""), t, c[t], h(lo[t]), h(hi[t])
            }
        }'
}

# With qemu still connected: what rawdisk says it owes (SIGUSR1's totals,
# "unanswered": requests read and not answered). Empty: qemu is not
# waiting on the server.
owes() { # server
    [[ $1 == rawdisk* || $1 == custom:* ]] || return 0
    local line=
    # A server that died would explain the silence too: say so.
    kill -USR1 "$pid" 2>/dev/null || { echo "guest.sh: $1: the server is gone" >&2; return 0; }
    for _ in $(seq 40); do
        line=$(grep -o '"unanswered":\[[^]]*\]' "$SERVER_LOG" | tail -n 1) && [ -n "$line" ] && break
        sleep 0.05
    done
    echo "guest.sh: $1: the server says ${line:-nothing (no SIGUSR1 line in $SERVER_LOG)}" >&2
}

# Requests in qemu's NBD trace FILE without their last reply chunk (or
# simple reply): "cookie type offset length", at most 20.
owed() { # file
    awk '
        /^nbd_send_request/ && match($0, /\.cookie = [0-9]+/) {
            c = substr($0, RSTART + 10, RLENGTH - 10)
            match($0, /\.from = [0-9]+, \.len = [0-9]+/); ol = substr($0, RSTART, RLENGTH)
            match($0, /\([a-z ]+\) }/); t = substr($0, RSTART + 1, RLENGTH - 4)
            if (t != "disconnect") { p[c] = t " " ol; order[++k] = c }  # no reply, by the spec
        }
        /^nbd_receive_simple_reply/ && match($0, /cookie = [0-9]+/) { delete p[substr($0, RSTART + 9, RLENGTH - 9)] }
        /^nbd_receive_reply_chunk_header/ && match($0, /flags = 0x[0-9a-f]+/) {
            # NBD_REPLY_FLAG_DONE is bit 0: an odd last hex digit.
            if (substr($0, RSTART + RLENGTH - 1, 1) ~ /[13579bdf]/ && match($0, /cookie = [0-9]+/))
                delete p[substr($0, RSTART + 9, RLENGTH - 9)]
        }
        END { for (i = 1; i <= k && n < 20; i++) if (order[i] in p) { print "cookie " order[i] ": " p[order[i]]; delete p[order[i]]; n++ } }' "$1"
}

# One boot against one server; appends "rep server workload seconds MiB/s
# IOPS cpu hwm" lines to $res and "server name value" to $res.queue; rep 0
# is the traced boot, its lines go to $res.trace.
one() { # rep server
    local line w s c0 cpu hwm t= f qfd tr=() tf=$work/trace.$2 m0 ps=() pf
    # discard=unmap: the guest's discards and zeroes that may unmap reach the
    # server as NBD trims (qemu drops them by default).
    rm -f "$img"
    truncate -s "$size" "$img"
    : >"$SERVER_LOG"
    serve "$2" "$img" "$sock" || die "$2 did not start"
    : >"$work/console"
    qargs "$accel" bench
    [ "$1" = 0 ] && tr=(-D "$tf" -trace enable=nbd_send_request) && : >"$tf"
    [ "$1" != 0 ] && [ "$nbdtrace" = 1 ] && tf=$work/nbd.$1.$2 &&
        tr=(-D "$tf" -trace enable=nbd_send_request -trace enable=nbd_receive_simple_reply
            -trace enable=nbd_receive_reply_chunk_header)
    exec {qfd}< <(exec timeout 1800 qemu-system-x86_64 "${qa[@]}" \
        -drive "file=nbd+unix:///?socket=$sock,format=raw,if=none,id=d,cache=none,discard=unmap" \
        -device virtio-blk-pci,drive=d "${tr[@]}" </dev/null 2>&1)
    qpid=$!
    # A console silent for $quiet seconds ends the loop with qemu running.
    while IFS= read -r -t "$quiet" -u "$qfd" line; do
        line=${line%$'\r'}
        echo "$line" >>"$work/console"
        read -r -a f <<<"$line"
        [ "${f[0]:-}" = "@@" ] || continue
        case ${f[1]} in
        begin) echo 5 >"/proc/$pid/clear_refs"; c0=$(cpu_of "$pid"); [ "$1" = 0 ] && m0=$(wc -l <"$tf")
            if [ "$sched" = 1 ] && [ "$1" != 0 ]; then
                pf=$work/perf.${f[2]}
                perf stat -x, -e task-clock,context-switches,cpu-migrations -p "$pid" -o "$pf.server" &
                ps=($!)
                # $qpid is timeout's; qemu is its child.
                perf stat -x, -e task-clock,context-switches,cpu-migrations -p "$(pgrep -P "$qpid" | head -1)" \
                    -o "$pf.qemu" &
                ps+=($!)
            fi ;;
        end) if ((${#ps[@]})); then
                kill -INT "${ps[@]}"
                wait "${ps[@]}" 2>/dev/null || true
                ps=()
                for who in server qemu; do
                    # "rep server workload who seconds switches migrations"
                    awk -F, -v r="$1" -v s="$2" -v w="${f[2]}" -v who="$who" -v t="${f[3]}" '
                        $3 == "context-switches" { cs = $1 } $3 == "cpu-migrations" { mg = $1 }
                        $3 == "task-clock" { tc = $1 / 1000 }
                        END { print r, s, w, who, t, cs, mg, tc }' "$pf.$who" >>"$res.sched"
                done
            fi
            if [ "$1" = 0 ]; then
                echo "${f[2]}|$2|$(requests "$tf" "$m0" "$(wc -l <"$tf")")" >>"$res.trace"
                continue
            fi
            cpu=$(awk -v a="$c0" -v b="$(cpu_of "$pid")" 'BEGIN { printf "%.3f", b - a }')
            hwm=$(hwm_of "$pid")
            w=${f[2]} s=${f[3]}
            [[ $w == seq-* || $w == rand-* ]] || echo "$1 $2 $w $s - - $cpu $hwm" >>"$res" ;;
        fio) [ "$1" = 0 ] ||
            echo "$1 $2 ${f[2]} $s ${f[3]} ${f[4]} $cpu $hwm" >>"$res" ;;
        # "rep server workload irqs requests busy%"
        guest) [ "$1" = 0 ] || echo "$1 $2 ${f[*]:2:4}" >>"$res.guest" ;;
        queue) [ "$1" = $((reps > 0)) ] && echo "$2 ${f[2]} ${f[3]:-}" >>"$res.queue" ;;
        error) die "$2: guest: ${f[*]:2}" ;;
        done) t=done ;;
        esac
    done
    local hung=
    if [ "$t" != done ] && kill -0 "$qpid" 2>/dev/null; then
        hung=" in ${quiet} s"
        owes "$2"
        kill "$qpid"
    fi
    exec {qfd}<&-
    wait "$qpid" || true
    qpid=
    if [ "$t" != done ]; then
        [ "$1" != 0 ] && [ "$nbdtrace" = 1 ] &&
            echo "guest.sh: $2: requests without a reply: $(owed "$tf" | tr '\n' ';')" >&2
        die "$2: the guest did not finish$hung (console: $(tail -n 5 "$work/console" | tr '\n' ' '))"
    fi
    # A finished boot's NBD trace answers nothing; kept, the traces would
    # fill the tmpfs the image is on, and a full image pauses the guest.
    if [ "$1" != 0 ] && [ "$nbdtrace" = 1 ]; then rm -f "$tf"; fi
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    pid=
    cmp -s -n "$(stat -c %s "$img")" "$img" /dev/zero || die "$2: the image is not zero after blkdiscard -z"
}

med() { sort -g | awk '{ v[NR] = $1 } END { if (!NR) print "-"; else print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
median() { sort -g | awk -v f="$1" '{ v[NR] = $1 } END {
    m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
    printf f " [" f "-" f "]", m, v[1], v[NR] }'; }

load0=$(cut -d' ' -f1-3 /proc/loadavg)
: >"$res"
n=$(wc -w <<<"$servers")
for r in $(seq "$reps"); do
    # rotate the order each repetition so that drift favours no server
    set -- $servers
    for i in $(seq 0 $((n - 1))); do
        k=$(((i + r - 1) % n + 1))
        one "$r" "${!k}"
    done
done
if [ "$trace" = 1 ]; then
    for s in $servers; do one 0 "$s"; done
fi

echo "<!-- bench/guest.sh $reps; SIZE=$size RUNTIME=$runtime; accel $accel$why; $(uname -r), $(nproc) cpus;" \
    "guest $(cat "$cache/kernel"); $(qemu-system-x86_64 --version | head -1); $(nbdkit --version | head -1);" \
    "$(qemu-nbd --version | head -1); load $load0 -> $(cut -d' ' -f1-3 /proc/loadavg) -->"
timed_table() {
    echo
    echo "| workload | unit | server | median [min-max] | / best anchor | server CPU s | peak RSS MiB |"
    echo "|---|---|---|---|---|---|---|"
    col() { awk -v s="$1" -v w="$2" -v c="$3" '$2 == s && $3 == w { print $c }' "$res"; }
    for w in mkfs fstrim seq-write seq-read rand-write rand-read blkdiscard-z; do
        case $w in seq-*) c=5 unit=MiB/s f=%.0f ;; rand-*) c=6 unit=IOPS f=%.0f ;; *) c=4 unit=s f=%.3f ;; esac
        best=
        for s in $servers; do
            [[ $s == rawdisk* || $s == nbdkit-memory ]] && continue
            m=$(col "$s" "$w" "$c" | med)
            if [ -z "$best" ] || awk -v a="$m" -v b="$best" -v u="$unit" 'BEGIN { exit !(u == "s" ? a < b : a > b) }'; then
                best=$m
            fi
        done
        for s in $servers; do
            m=$(col "$s" "$w" "$c" | med)
            printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$w" "$unit" "$s" "$(col "$s" "$w" "$c" | median "$f")" \
                "$(awk -v a="$m" -v b="${best:-0}" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }')" \
                "$(col "$s" "$w" 7 | med)" "$(col "$s" "$w" 8 | med)"
        done
    done
}
[ "$reps" = 0 ] || timed_table
queue_table() {
    echo
    printf '| queue limit |'
    for s in $servers; do printf ' %s |' "$s"; done
    printf '\n|---|'
    for s in $servers; do printf -- '---|'; done
    echo
    for a in $(awk '{ print $2 }' "$res.queue" | awk '!seen[$0]++'); do
        printf '| %s |' "$a"
        for s in $servers; do printf ' %s |' "$(awk -v s="$s" -v a="$a" '$1 == s && $2 == a { print $3 }' "$res.queue")"; done
        echo
    done
}
[ -s "$res.queue" ] && queue_table
# The workloads (third field) of FILE, in the order they first appear.
workloads_in() { awk '!seen[$3]++ { print $3 }' "$1"; }
# No virtio-blk MSI-X vector found in the guest (0 interrupts) shows as "-",
# not as 0 interrupts a request.
# Under TCG the vCPU thread does the guest's work: a guest busy near 100 %
# bounds the rows whatever the server, and fewer interrupts a request (the
# virtio completions batched) leave it more time for fio.
if [ -s "$res.guest" ]; then
    echo
    echo "| workload | server | guest busy % | virtio interrupts a request |"
    echo "|---|---|---|---|"
    for w in $(workloads_in "$res.guest"); do
        for s in $servers; do
            g() { awk -v s="$s" -v w="$w" "\$2 == s && \$3 == w { $1 }" "$res.guest" | med; }
            printf '| %s | %s | %s | %s |\n' "$w" "$s" "$(g 'print $6')" \
                "$(g 'if ($4 > 0 && $5 > 0) printf "%.2f\n", $4 / $5')"
        done
    done
fi
if [ -s "$res.sched" ]; then
    echo
    echo "| workload | server | server CPUs | server switches/s | server migrations/s | qemu CPUs | qemu switches/s | qemu migrations/s |"
    echo "|---|---|---|---|---|---|---|---|"
    for w in $(workloads_in "$res.sched"); do
        for s in $servers; do
            printf '| %s | %s |' "$w" "$s"
            for who in server qemu; do
                for c in 8 6 7; do
                    printf ' %s |' "$(awk -v s="$s" -v w="$w" -v who="$who" -v c="$c" \
                        '$2 == s && $3 == w && $4 == who && $5 > 0 { printf(c == 8 ? "%.2f\n" : "%.0f\n", $c / $5) }' "$res.sched" | med)"
                done
            done
            echo
        done
    done
fi
if [ "$trace" = 1 ]; then
    echo
    echo "| workload | server | NBD requests from qemu: type count [smallest-largest] |"
    echo "|---|---|---|"
    awk -F'|' '{ printf "| %s | %s | %s |\n", $1, $2, $3 }' "$res.trace"
fi
