#!/bin/bash
# bench/tls-tcp.sh -- TLS over TCP on loopback: `rawdisk serve` beside
# `nbdkit --tls=require` and `qemu-nbd --tls-creds` (X.509, page cache),
# fio's nbd engine (nbds://127.0.0.1) reading and writing over one
# connection and over several (numjobs, each job its own connection),
# `nbdcopy -C N` of an image into the export and out of it, and `qemu-img
# convert -n -W -m 16` of a sparse image into the export (dirty
# destination). Not a test: prints medians, paired ratios, the server's
# CPU seconds per GiB moved and its peak memory.
#
# Usage: bench/tls-tcp.sh
# Environment:
#   RAWDISK_BIN  rawdisk binary (default target/release/rawdisk)
#   SERVERS      default "rawdisk nbdkit qemu-nbd" (order rotates per rep);
#                rawdisk-NAME runs the binary in $RAWDISK_BIN_NAME, to put
#                two builds side by side against the same anchors
#   BENCH_REPS   repetitions (default 5)
#   TP_JOBS      fio jobs rw:bs:iodepth[:numjobs] (default: 4 KiB and 1 MiB
#                reads and writes at qd16, one job and four jobs)
#   TP_SIZE      export size for fio (default 512M), TP_RUNTIME seconds (3);
#                with numjobs N each job covers its own 1/N of the export
#   COPY_SIZE    image for nbdcopy, random data (default 1G; 0 skips it)
#   COPY_CONNS   nbdcopy -C (default 4)
#   SRC_IMG      raw image to convert (default: none, the convert is skipped)
#   WORK         work directory, in RAM (default /dev/shm/rawdisk-tls-tcp)
#   PORT         TCP port (default 10899)
#
# The certificates are made here (openssl), for localhost/127.0.0.1. The
# libnbd clients (fio's nbd engine) find the CA in $HOME/.pki/libnbd, so
# HOME points into WORK for them. Per run the server's CPU is utime+stime
# of /proc/PID/stat (all its threads) from after the readiness probe to
# before SIGTERM; peak RSS is its VmHWM, peak RssAnon (private memory:
# shared library pages are not the server's cost) is sampled every 50 ms
# from /proc/PID/status and once more before SIGTERM.

set -euo pipefail
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
: "${RAWDISK_BIN:=$HERE/../target/release/rawdisk}"
: "${SERVERS:=rawdisk nbdkit qemu-nbd}"
: "${BENCH_REPS:=5}"
: "${TP_JOBS:=read:4k:16 write:4k:16 read:1M:16 write:1M:16 read:4k:16:4 write:4k:16:4 read:1M:16:4 write:1M:16:4}"
: "${COPY_SIZE:=1G}" "${COPY_CONNS:=4}"
: "${TP_SIZE:=512M}" "${TP_RUNTIME:=3}"
: "${WORK:=/dev/shm/rawdisk-tls-tcp}"
: "${PORT:=10899}"
: "${SRC_IMG:=}"
die() { echo "tls-tcp.sh: $*" >&2; exit 2; }
for t in fio nbdkit qemu-nbd qemu-img nbdinfo nbdcopy openssl; do
  command -v $t >/dev/null || die "needs $t"
done
[[ -x $RAWDISK_BIN ]] || die "no rawdisk binary at $RAWDISK_BIN (cargo build --release)"

rm -rf "$WORK"; mkdir -p "$WORK/pki" "$WORK/home/.pki/libnbd"
PKI=$WORK/pki
SRV_PID=
SAMPLER=
cleanup() {
  if [[ -n $SAMPLER ]]; then kill "$SAMPLER" 2>/dev/null; fi
  if [[ -n $SRV_PID ]]; then kill "$SRV_PID" 2>/dev/null; fi
  wait 2>/dev/null; rm -rf "$WORK"
}
trap cleanup EXIT

# A throwaway CA and a server certificate (nothing secret is kept).
(
  cd "$PKI"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca-key.pem -out ca-cert.pem -days 2 \
    -subj "/CN=tls-tcp bench CA" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout server-key.pem -out server.csr \
    -subj "/CN=localhost" 2>/dev/null
  printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' > ext
  openssl x509 -req -in server.csr -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial \
    -out server-cert.pem -days 2 -extfile ext 2>/dev/null
)
cp "$PKI/ca-cert.pem" "$WORK/home/.pki/libnbd/"
URI="nbds://127.0.0.1:$PORT/"

start() { # server file
  case $1 in
    rawdisk*) local bin=$RAWDISK_BIN v=RAWDISK_BIN_${1#rawdisk-}
              [[ $1 == rawdisk ]] || bin=${!v:?$v names no binary}
              "$bin" serve -b "127.0.0.1:$PORT" --tls-certificates "$PKI" "$2" \
               >/dev/null 2>&1 & ;;
    nbdkit) nbdkit -f -i 127.0.0.1 -p "$PORT" --tls=require --tls-certificates="$PKI" \
              file file="$2" >/dev/null 2>&1 & ;;
    qemu-nbd) qemu-nbd -f raw -t -e 8 -b 127.0.0.1 -p "$PORT" --cache=writeback --aio=threads \
                --object "tls-creds-x509,id=tls0,dir=$PKI,endpoint=server,verify-peer=off" \
                --tls-creds tls0 "$2" >/dev/null 2>&1 & ;;
  esac
  SRV_PID=$!
  for _ in $(seq 200); do
    HOME=$WORK/home nbdinfo --size "$URI" >/dev/null 2>&1 && return 0
    sleep 0.05
  done
  die "$1 did not start"
}
cpu_ticks() { # utime + stime of every thread of $SRV_PID (fields 14, 15; comm has no blanks)
  awk '{print $14 + $15}' "/proc/$SRV_PID/stat"
}
HZ=$(getconf CLK_TCK)
# Peak RssAnon of a pid every 50 ms, written to a file on SIGTERM or when
# the pid is gone (a python loop: forking `sleep` 20 times a second would
# cost the host more than the reading does).
sample() { # pid file
  python3 - "$1" "$2" <<'PY' &
import signal, sys, time
pid, out = sys.argv[1], sys.argv[2]
peak = 0
def done(*_):
    open(out, "w").write("%d\n" % peak)
    sys.exit(0)
signal.signal(signal.SIGTERM, done)
while True:
    try:
        for line in open("/proc/%s/status" % pid):
            if line.startswith("RssAnon:"):
                peak = max(peak, int(line.split()[1]))
    except OSError:
        done()
    time.sleep(0.05)
PY
  SAMPLER=$!
}
begin() { # server file: start it, then count its CPU and sample its memory from here
  start "$1" "$2"
  CPU0=$(cpu_ticks)
  sample "$SRV_PID" "$WORK/anon"
}
# Sets RSS (VmHWM, KiB), ANON (peak RssAnon, KiB), CPU (server seconds since
# begin); not in a subshell: it waits.
stop() {
  local now
  RSS=$(awk '/VmHWM/{print $2}' "/proc/$SRV_PID/status")
  now=$(awk '/RssAnon/{print $2}' "/proc/$SRV_PID/status")
  CPU=$(python3 -c "print(round(($(cpu_ticks) - $CPU0) / $HZ, 2))")
  kill "$SAMPLER"; wait "$SAMPLER" 2>/dev/null || true; SAMPLER=
  ANON=$(cat "$WORK/anon"); ((now > ANON)) && ANON=$now
  kill "$SRV_PID"; wait "$SRV_PID" 2>/dev/null || true; SRV_PID=
}
record() { # workload server rep value gib
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$RSS" "$ANON" "$CPU" "$5" >> "$OUT"
  echo "rep $3 $1 $2: $4, cpu $CPU s for $5 GiB, peak RSS $((RSS / 1024)) MiB, RssAnon $((ANON / 1024)) MiB" >&2
}

OUT=$WORK.$$.tsv  # kept after the work directory is removed
printf 'workload\tserver\trep\tvalue\trss_kb\tanon_kb\tcpu_s\tgib\n' > "$OUT"
read -ra SRVS <<< "$SERVERS"
rotate() { local r=$1; local n=${#SRVS[@]}; for i in $(seq 0 $((n - 1))); do echo "${SRVS[$(((i + r) % n))]}"; done; }

F=$WORK/disk.img
for rep in $(seq "$BENCH_REPS"); do
  for job in $TP_JOBS; do
    IFS=: read -r rw bs qd nj <<< "$job"
    nj=${nj:-1}
    # fio's nbd engine makes one libnbd handle, so one connection, per job;
    # each job takes its own slice of the export.
    part=$(($(numfmt --from=iec "$TP_SIZE") / nj))
    name="fio $rw $bs qd$qd"; ((nj > 1)) && name="$name x$nj conns"
    for s in $(rotate "$rep"); do
      [[ -f $F ]] || head -c "$TP_SIZE" /dev/urandom > "$F"
      begin "$s" "$F"
      HOME=$WORK/home fio --name=j --ioengine=nbd --uri="$URI" --rw="$rw" --bs="$bs" \
        --iodepth="$qd" --numjobs="$nj" --size="$part" --offset_increment="$part" \
        --group_reporting --runtime="$TP_RUNTIME" --time_based \
        --output-format=json --output="$WORK/fio.json" >/dev/null 2>&1
      stop
      read -r mib gib < <(python3 -c 'import json,sys; d=json.load(open(sys.argv[1]))["jobs"][0][sys.argv[2]]; print(round(d["bw_bytes"]/2**20), round(d["io_bytes"]/2**30, 3))' "$WORK/fio.json" "$rw")
      record "$name (MiB/s)" "$s" "$rep" "$mib" "$gib"
    done
  done
  if [[ $COPY_SIZE != 0 ]]; then
    C=$WORK/copy-src.img
    [[ -f $C ]] || head -c "$COPY_SIZE" /dev/urandom > "$C"
    csize=$(stat -c %s "$C"); cgib=$(python3 -c "print(round($csize / 2**30, 3))")
    [[ -f $WORK/copy-dirty.img ]] || head -c "$csize" /dev/urandom > "$WORK/copy-dirty.img"
    for s in $(rotate "$rep"); do
      cp "$WORK/copy-dirty.img" "$WORK/export.img"
      rm -f "$WORK/out.img"
      # The export's file stays on tmpfs: the copy out reads what came in.
      for dir in into "out of"; do
        if [[ $dir == into ]]; then from=$C to=$URI got=$WORK/export.img
        else from=$URI to=$WORK/out.img got=$WORK/out.img; fi
        begin "$s" "$WORK/export.img"
        t0=$(date +%s%N)
        HOME=$WORK/home nbdcopy -C "$COPY_CONNS" "$from" "$to"
        t1=$(date +%s%N)
        stop
        cmp -s "$C" "$got" || die "nbdcopy $dir $s: the data differs from the source image"
        record "nbdcopy -C $COPY_CONNS $dir (MiB/s)" "$s" "$rep" \
          "$(python3 -c "print(round($csize / 2**20 / (($t1 - $t0) / 1e9)))")" "$cgib"
      done
    done
    rm -f "$WORK/out.img" "$WORK/export.img"
  fi
  if [[ -n $SRC_IMG ]]; then
    size=$(stat -c %s "$SRC_IMG")
    [[ -f $WORK/dirty.img ]] || head -c "$size" /dev/urandom > "$WORK/dirty.img"
    for s in $(rotate "$rep"); do
      cp "$WORK/dirty.img" "$WORK/dst.img"
      begin "$s" "$WORK/dst.img"
      t0=$(date +%s%N)
      qemu-img convert -n -W -m 16 -f raw \
        --object "tls-creds-x509,id=tls0,dir=$PKI,endpoint=client" \
        --target-image-opts "$SRC_IMG" \
        "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port=$PORT,tls-creds=tls0"
      t1=$(date +%s%N)
      stop
      cmp -s "$SRC_IMG" "$WORK/dst.img" || die "convert into $s: the export differs from the source"
      record "convert dirty -W (s)" "$s" "$rep" "$(python3 -c "print(round(($t1 - $t0) / 1e9, 3))")" \
        "$(python3 -c "print(round($size / 2**30, 3))")"
    done
  fi
done

# Medians [min-max], and rawdisk against the best anchor paired within each
# rep: for the workload's figure and for the server's CPU per GiB moved.
python3 - "$OUT" <<'PY'
import csv, statistics as st, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
work = list(dict.fromkeys(r["workload"] for r in rows))
servers = list(dict.fromkeys(r["server"] for r in rows))
anchors = [s for s in servers if not s.startswith("rawdisk")]
subjects = [s for s in servers if s.startswith("rawdisk")]

def span(xs, f):
    return (f + " [" + f + "-" + f + "]") % (st.median(xs), min(xs), max(xs)) if xs else "-"

def table(title, value, higher_better, fmt):
    print("\n" + title + ", median [min-max]; rawdisk over the best anchor in this figure"
          " and over the faster anchor, paired per rep")
    heads = ["%s / %s" % (m, a) for m in subjects for a in ("best", "faster")]
    print("| workload | " + " | ".join(servers + heads) + " |")
    print("|---" * (len(servers) + len(heads) + 1) + "|")
    for w in work:
        by = {(r["server"], r["rep"]): r for r in rows if r["workload"] == w}
        reps = sorted({rep for (_, rep) in by})
        cells = [span([value(by[(s, r)], w) for r in reps if (s, r) in by], fmt) for s in servers]
        for m in subjects:
            best, faster = [], []
            for r in reps:
                a = [s for s in anchors if (s, r) in by]
                if (m, r) not in by or not a:
                    continue
                mine = value(by[(m, r)], w)
                vals = [value(by[(s, r)], w) for s in a]
                best.append(mine / (max(vals) if higher_better(w) else min(vals)))
                # The anchor that was faster in this rep (the issue's reference).
                figs = [float(by[(s, r)]["value"]) for s in a]
                fast = a[figs.index(max(figs) if "(s)" not in w else min(figs))]
                faster.append(mine / value(by[(fast, r)], w))
            cells += [span(best, "%.2f"), span(faster, "%.2f")]
        print("| %s | %s |" % (w, " | ".join(cells)))

table("Workload figure", lambda r, w: float(r["value"]), lambda w: "(s)" not in w, "%g")
table("Server CPU s per GiB moved", lambda r, w: float(r["cpu_s"]) / float(r["gib"]),
      lambda w: False, "%.2f")
table("Peak RssAnon MiB", lambda r, w: int(r["anon_kb"]) / 1024, lambda w: False, "%.1f")
table("Peak RSS (VmHWM) MiB", lambda r, w: int(r["rss_kb"]) / 1024, lambda w: False, "%.1f")
print("\n(throughput: ratio above 1 is faster; times, CPU and memory: below 1 is less)")
PY
echo "raw results: $OUT" >&2
