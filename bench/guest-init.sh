#!/bin/sh
# /init of the guest bench/guest.sh boots (busybox sh, PID 1). Runs the
# workloads on /dev/vda and prints one "@@ " line per event on the serial
# console for the host to parse; powers off at the end. Tools by full path:
# busybox sh runs its own applets (blkdiscard, fstrim) before PATH.
#   @@ up                        the kernel reached init (accelerator probe)
#   @@ queue NAME VALUE          /sys/block/vda/queue/NAME as this server set it
#   @@ begin NAME                a workload starts (after a pause: the host
#                                samples the server's CPU when it reads this)
#   @@ end NAME SECONDS
#   @@ guest NAME IRQS IOS BUSY  after each end: virtio-blk interrupts and
#                                requests completed, and the percent of the
#                                vCPU's time not idle, during NAME
#   @@ fio NAME MIB_PER_S IOPS     after a fio workload's end
#   @@ error NAME TEXT           and then poweroff
#   @@ done
/bin/busybox mkdir -p /proc /sys /dev /mnt /tmp
/bin/busybox mount -t proc proc /proc
/bin/busybox --install -s
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
export PATH=/usr/local/sbin:/sbin:/usr/sbin:/bin:/usr/bin
export LD_LIBRARY_PATH=/lib/x86_64-linux-gnu
echo "@@ up"
arg() { sed -n "s/.*rdguest\.$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
off() { sync; poweroff -f; sleep 10; }
[ "$(arg mode)" = probe ] && off
for m in $(cat /modules.list); do
    insmod "/lib/modules/$m.ko" || echo "@@ error insmod $m"
done
runtime=$(arg runtime)
dev=/dev/vda
for _ in $(seq 50); do [ -b $dev ] && break; sleep 0.1; done
[ -b $dev ] || { echo "@@ error vda no /dev/vda"; off; }
q=/sys/block/vda/queue
for f in logical_block_size physical_block_size minimum_io_size optimal_io_size \
    max_sectors_kb max_hw_sectors_kb max_segments max_segment_size nr_requests \
    discard_granularity discard_max_bytes discard_max_hw_bytes write_zeroes_max_bytes \
    rotational write_cache; do
    echo "@@ queue $f $(cat $q/$f 2>/dev/null | tr ' ' _)"
done
echo "@@ queue size_bytes $(($(cat /sys/block/vda/size) * 512))"

# Monotonic nanoseconds (busybox date has no %N).
now() { awk '/^now at/ { print $3; exit }' /proc/timer_list; }
# What the guest did: "IRQS IOS TICKS IDLE" counters, virtio-blk's request
# interrupts (MSI-X vectors named virtioN-req.Q), requests completed (reads
# + writes in /sys/block/vda/stat) and /proc/stat's CPU ticks: all, and idle
# + iowait.
counters() {
    irq=$(awk '/virtio[0-9]+-req/ { for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) n += $i } END { print n + 0 }' /proc/interrupts)
    ios=$(awk '{ print $1 + $5 }' /sys/block/vda/stat)
    echo "$irq $ios $(awk '$1 == "cpu" { t = 0; for (i = 2; i <= 9; i++) t += $i; print t, $5 + $6; exit }' /proc/stat)"
}
# run NAME CMD...: times CMD, prints "@@ end NAME SECONDS" and "@@ guest
# NAME ..."; output in /tmp/out.
run() {
    name=$1
    shift
    echo "@@ begin $name"
    sleep 0.3
    c0=$(counters)
    t0=$(now)
    "$@" >/tmp/out 2>&1 || { echo "@@ error $name $(tail -n 3 /tmp/out | tr '\n' ' ')"; off; }
    t1=$(now)
    c1=$(counters)
    echo "@@ end $name $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", (b - a) / 1e9 }')"
    # (A bare ">" among printf's arguments would redirect its output.)
    echo "$c0 $c1" | awk -v n="$name" '{ t = $7 - $3; b = 0
        if (t > 0) b = 100 * (1 - ($8 - $4) / t)
        printf "@@ guest %s %d %d %.1f\n", n, $5 - $1, $6 - $2, b }'
}
# fio in terse v3: field 7/8 read KiB/s and IOPS, 48/49 the same for writes.
fio_run() { # name rw bs [fio args]
    name=$1 rw=$2 bs=$3
    shift 3
    run "$name" fio --name="$name" --filename=$dev --ioengine=libaio --direct=1 --iodepth=16 \
        --rw="$rw" --bs="$bs" --output-format=terse --terse-version=3 "$@"
    line=$(grep "^3;" /tmp/out)
    case $rw in *read) bw=7 io=8 ;; *) bw=48 io=49 ;; esac
    echo "@@ fio $name $(echo "$line" | awk -F';' -v b=$bw -v i=$io '{ printf "%.1f %.0f", $b / 1024, $i }')"
}

run mkfs /usr/local/sbin/mkfs.ext4 -F -q -E discard $dev
mount -t ext4 $dev /mnt || { echo "@@ error mount"; off; }
# Blocks that held data, freed, so that fstrim returns real extents.
dd if=/dev/zero of=/mnt/f bs=1M count=256 conv=fsync 2>/dev/null
rm /mnt/f
sync
run fstrim /usr/local/sbin/fstrim /mnt
umount /mnt
fio_run seq-write write 1M --end_fsync=1
fio_run seq-read read 1M
fio_run rand-write randwrite 4k --time_based --runtime="$runtime" --end_fsync=1 --randrepeat=0 --norandommap
fio_run rand-read randread 4k --time_based --runtime="$runtime" --randrepeat=0 --norandommap
run blkdiscard-z /usr/local/sbin/blkdiscard -z $dev
echo "@@ done"
off
