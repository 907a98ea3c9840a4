#!/bin/bash
# bench/tls-tcp.sh -- TLS over TCP on loopback: `rawdisk serve` beside
# `nbdkit --tls=require` and `qemu-nbd --tls-creds` (X.509, page cache),
# fio's nbd engine (nbds://127.0.0.1) reading and writing, and `qemu-img
# convert -n -W -m 16` of a sparse image into the export (dirty
# destination). Not a test: prints medians, paired ratios and peak RSS.
#
# Usage: bench/tls-tcp.sh
# Environment:
#   RAWDISK_BIN  rawdisk binary (default target/release/rawdisk)
#   SERVERS      default "rawdisk nbdkit qemu-nbd" (order rotates per rep)
#   BENCH_REPS   repetitions (default 5)
#   TP_JOBS      fio jobs rw:bs:iodepth (default "read:4k:16 write:4k:16
#                read:1M:16 write:1M:16")
#   TP_SIZE      export size for fio (default 512M), TP_RUNTIME seconds (3)
#   SRC_IMG      raw image to convert (default: none, the convert is skipped)
#   WORK         work directory, in RAM (default /dev/shm/rawdisk-tls-tcp)
#   PORT         TCP port (default 10899)
#
# The certificates are made here (openssl), for localhost/127.0.0.1. The
# libnbd clients (fio's nbd engine) find the CA in $HOME/.pki/libnbd, so
# HOME points into WORK for them. Peak RSS is the server's VmHWM.

set -euo pipefail
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
: "${RAWDISK_BIN:=$HERE/../target/release/rawdisk}"
: "${SERVERS:=rawdisk nbdkit qemu-nbd}"
: "${BENCH_REPS:=5}"
: "${TP_JOBS:=read:4k:16 write:4k:16 read:1M:16 write:1M:16}"
: "${TP_SIZE:=512M}" "${TP_RUNTIME:=3}"
: "${WORK:=/dev/shm/rawdisk-tls-tcp}"
: "${PORT:=10899}"
: "${SRC_IMG:=}"
die() { echo "tls-tcp.sh: $*" >&2; exit 2; }
for t in fio nbdkit qemu-nbd qemu-img nbdinfo openssl; do
  command -v $t >/dev/null || die "needs $t"
done
[[ -x $RAWDISK_BIN ]] || die "no rawdisk binary at $RAWDISK_BIN (cargo build --release)"

rm -rf "$WORK"; mkdir -p "$WORK/pki" "$WORK/home/.pki/libnbd"
PKI=$WORK/pki
SRV_PID=
cleanup() { if [[ -n $SRV_PID ]]; then kill "$SRV_PID" 2>/dev/null; fi; wait 2>/dev/null; rm -rf "$WORK"; }
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
    rawdisk) "$RAWDISK_BIN" serve -b "127.0.0.1:$PORT" --tls-certificates "$PKI" "$2" \
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
stop() { # sets RSS: the server's peak RSS in KiB (not in a subshell: it waits)
  RSS=$(awk '/VmHWM/{print $2}' "/proc/$SRV_PID/status")
  kill "$SRV_PID"; wait "$SRV_PID" 2>/dev/null || true; SRV_PID=
}

OUT=$WORK.$$.tsv  # kept after the work directory is removed
printf 'workload\tserver\trep\tvalue\trss_kb\n' > "$OUT"
read -ra SRVS <<< "$SERVERS"
rotate() { local r=$1; local n=${#SRVS[@]}; for i in $(seq 0 $((n - 1))); do echo "${SRVS[$(((i + r) % n))]}"; done; }

F=$WORK/disk.img
for rep in $(seq "$BENCH_REPS"); do
  for job in $TP_JOBS; do
    IFS=: read -r rw bs qd <<< "$job"
    for s in $(rotate "$rep"); do
      [[ -f $F ]] || head -c "$TP_SIZE" /dev/urandom > "$F"
      start "$s" "$F"
      HOME=$WORK/home fio --name=j --ioengine=nbd --uri="$URI" --rw="$rw" --bs="$bs" \
        --iodepth="$qd" --size="$TP_SIZE" --runtime="$TP_RUNTIME" --time_based \
        --output-format=json --output="$WORK/fio.json" >/dev/null 2>&1
      stop; rss=$RSS
      mib=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(round(d["jobs"][0][sys.argv[2]]["bw_bytes"]/2**20))' "$WORK/fio.json" "$rw")
      printf '%s\t%s\t%s\t%s\t%s\n' "fio $rw $bs qd$qd (MiB/s)" "$s" "$rep" "$mib" "$rss" >> "$OUT"
      echo "rep $rep fio $rw $bs qd$qd $s: $mib MiB/s, peak RSS $((rss / 1024)) MiB" >&2
    done
  done
  if [[ -n $SRC_IMG ]]; then
    size=$(stat -c %s "$SRC_IMG")
    [[ -f $WORK/dirty.img ]] || head -c "$size" /dev/urandom > "$WORK/dirty.img"
    for s in $(rotate "$rep"); do
      cp "$WORK/dirty.img" "$WORK/dst.img"
      start "$s" "$WORK/dst.img"
      t0=$(date +%s%N)
      qemu-img convert -n -W -m 16 -f raw \
        --object "tls-creds-x509,id=tls0,dir=$PKI,endpoint=client" \
        --target-image-opts "$SRC_IMG" \
        "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port=$PORT,tls-creds=tls0"
      t1=$(date +%s%N)
      stop; rss=$RSS
      cmp -s "$SRC_IMG" "$WORK/dst.img" || die "convert into $s: the export differs from the source"
      sec=$(python3 -c "print(round(($t1 - $t0) / 1e9, 3))")
      printf '%s\t%s\t%s\t%s\t%s\n' "convert dirty -W (s)" "$s" "$rep" "$sec" "$rss" >> "$OUT"
      echo "rep $rep convert $s: $sec s, peak RSS $((rss / 1024)) MiB" >&2
    done
  fi
done

# Medians, and rawdisk against the best anchor paired within each rep.
python3 - "$OUT" <<'PY'
import csv, statistics as st, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
work = list(dict.fromkeys(r["workload"] for r in rows))
servers = list(dict.fromkeys(r["server"] for r in rows))
anchors = [s for s in servers if s != "rawdisk"]
print("| workload | " + " | ".join(servers) + " | rawdisk / best anchor | peak RSS MiB (" + ", ".join(servers) + ") |")
print("|---" * (len(servers) + 3) + "|")
for w in work:
    by = {(r["server"], r["rep"]): r for r in rows if r["workload"] == w}
    reps = sorted({rep for (_, rep) in by})
    med = {s: st.median(float(by[(s, r)]["value"]) for r in reps if (s, r) in by) for s in servers}
    rss = {s: st.median(int(by[(s, r)]["rss_kb"]) for r in reps if (s, r) in by) / 1024 for s in servers}
    higher = w.startswith("fio")
    ratios = []
    for r in reps:
        if ("rawdisk", r) not in by:
            continue
        a = [float(by[(s, r)]["value"]) for s in anchors if (s, r) in by]
        if not a:
            continue
        best = max(a) if higher else min(a)
        ratios.append(float(by[("rawdisk", r)]["value"]) / best)
    ratio = "%.2f [%.2f-%.2f]" % (st.median(ratios), min(ratios), max(ratios)) if ratios else "-"
    print("| %s | %s | %s | %s |" % (w, " | ".join("%g" % med[s] for s in servers), ratio,
                                     ", ".join("%.1f" % rss[s] for s in servers)))
print("\n(fio: ratio above 1 is faster; convert: below 1 is faster)")
PY
echo "raw results: $OUT" >&2
