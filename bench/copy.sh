#!/bin/bash
# bench/copy.sh -- `rawdisk copy` beside `qemu-img convert -n -W -m 16` and
# `nbdcopy`: the seed workload (the sparse image from the harness's
# make-image.sh) into each target kind, the destination dirty
# (every byte previously written), to the local target and through NBD
# servers exporting it. Not a test: prints medians and ratios.
#
# Usage (root): bench/copy.sh [TARGET...]      (default: tmpfs ext4 xfs blk)
# Environment:
#   RAWDISK_BIN   rawdisk binary (default target/release/rawdisk)
#   COPY_MODES    where the copy goes: "local" (the target itself) and NBD
#                 servers exporting it: nbdkit, qemu-nbd, rawdisk (rawdisk
#                 serve); default "local nbdkit qemu-nbd"
#   COPY_TOOLS    which copies to time (default: all six below)
#   BENCH_REPS    repetitions (default 3); tools rotate order every rep
#   BENCH         the NBD benchmark harness directory (required: its
#                 targets.sh and make-image.sh build the targets and the image)
#   SRC_IMG, IMG_SIZE (default 2G), BENCH_WORK: see the harness's README
#
# Each run: target dirtied (untimed), [server started], copy timed, [server
# stopped], destination compared with the source (cmp): a run that fails or
# differs is reported, not counted. Ratio = rawdisk / min(qemu-img, nbdcopy)
# within each repetition: median [min-max] over the repetitions.
# qemu-img (output cache unsafe) and nbdcopy do not flush the destination;
# rawdisk does unless --no-flush. Both pairings are measured: rawdisk against
# qemu-img -t writeback and nbdcopy --flush, rawdisk --no-flush against the
# plain two.

set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[[ -n "${BENCH:-}" ]] || { echo "copy.sh: set BENCH to the directory of the NBD benchmark harness (nbdkit/qemu-nbd/rawdisk side by side)" >&2; exit 2; }
: "${RAWDISK_BIN:=$HERE/../target/release/rawdisk}"
RAWDISK_BIN=$(realpath "$RAWDISK_BIN")
: "${IMG_SIZE:=2G}"
export IMG_SIZE
: "${COPY_MODES:=local nbdkit qemu-nbd}"
: "${COPY_TOOLS:=rawdisk rawdisk-noflush qemu-img nbdcopy qemu-img-flush nbdcopy-flush}"

# shellcheck source=/dev/null
source "$BENCH/targets.sh"

[[ $(id -u) == 0 ]] || die "needs root (mounts, loop devices)"
[[ -x "$RAWDISK_BIN" ]] || die "no rawdisk binary at $RAWDISK_BIN (cargo build --release)"
export SERVER_CMD_rawdisk="$RAWDISK_BIN serve --socket {socket} {file}"
server_kind() { # mode -> the harness's server kind
  case "$1" in
    rawdisk) echo custom:rawdisk ;;
    *) echo "$1" ;;
  esac
}
TARGETS=("$@")
[[ ${#TARGETS[@]} -gt 0 ]] || TARGETS=(tmpfs ext4 xfs blk)

bash "$BENCH/make-image.sh" "$SRC_IMG"
size=$(stat -c %s "$SRC_IMG")
cat "$SRC_IMG" > /dev/null   # page cache: measure the copy, not the source disk
OUT="$BENCH_WORK/copy-bench.$$.tsv"
printf 'target\tmode\ttool\trep\tseconds\tok\n' > "$OUT"
log "copy bench: $SRC_IMG ($size bytes) -> ${TARGETS[*]} modes=[$COPY_MODES] reps=$BENCH_REPS"
log "tools: $("$RAWDISK_BIN" --version) | $(qemu-img --version | head -1) | $(nbdcopy --version | head -1)"

run_tool() { # tool dst -> runs the copy of $SRC_IMG to dst
  case "$1" in
    rawdisk) RUST_LOG=warn "$RAWDISK_BIN" copy -q "$SRC_IMG" "$2" ;;
    # qemu-img (cache=unsafe for the output) and nbdcopy (no --flush) do not
    # flush the destination; rawdisk does by default. Both are shown.
    rawdisk-noflush) RUST_LOG=warn "$RAWDISK_BIN" copy -q --no-flush "$SRC_IMG" "$2" ;;
    qemu-img) qemu-img convert -n -W -m 16 -f raw -O raw "$SRC_IMG" "$2" ;;
    nbdcopy) nbdcopy "$SRC_IMG" "$2" ;;
    # The same two made to flush like rawdisk's default: qemu-img's output
    # cache mode writeback instead of unsafe (fdatasync or NBD FLUSH at
    # close), nbdcopy --flush.
    qemu-img-flush) qemu-img convert -n -W -m 16 -t writeback -f raw -O raw "$SRC_IMG" "$2" ;;
    nbdcopy-flush) nbdcopy --flush "$SRC_IMG" "$2" ;;
  esac
}

for tgt in "${TARGETS[@]}"; do
  target_setup "$tgt" "$size"
  target_dirty
  for ((rep = 1; rep <= BENCH_REPS; rep++)); do
    for mode in $COPY_MODES; do
      # shellcheck disable=SC2086
      mapfile -t order < <(rotate "$((rep - 1))" $COPY_TOOLS)
      for tool in "${order[@]}"; do
        target_dirty
        sync
        dst=$TARGET_PATH
        if [[ "$mode" != local ]]; then
          srv=$(server_kind "$mode")
          server_start "$srv" "$TARGET_PATH" "$size" || die "server $srv failed"
          dst=$SRV_URI
        fi
        t0=$(now)
        set +e
        run_tool "$tool" "$dst" 2> "$BENCH_WORK/copy-bench.err"
        rc=$?
        set -e
        t1=$(now)
        [[ "$mode" != local ]] && server_stop
        dt=$(elapsed "$t0" "$t1")
        ok=1
        if ((rc != 0)); then
          ok=0; log "$tool rc=$rc: $(head -c 300 "$BENCH_WORK/copy-bench.err")"
        elif ! verify_same "$SRC_IMG" "$TARGET_PATH" "$size"; then
          ok=0; log "$tool: DESTINATION DIFFERS FROM SOURCE"
        fi
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$tgt" "$mode" "$tool" "$rep" "$dt" "$ok" >> "$OUT"
        log "$tgt $mode $tool rep$rep: ${dt}s ok=$ok"
      done
    done
  done
  target_teardown
done

# Medians of the good runs; the ratio to the faster other tool is paired:
# within each repetition, then the median and the spread over repetitions.
echo
echo "| target | mode | rawdisk s | qemu-img -t writeback s | nbdcopy --flush s | rawdisk / best flushing other | rawdisk --no-flush s | qemu-img s | nbdcopy s | --no-flush / best other |"
echo "|---|---|---|---|---|---|---|---|---|---|"
"$PY" - "$OUT" <<'EOF'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
keys = []
for r in rows:
    k = (r["target"], r["mode"])
    if k not in keys:
        keys.append(k)
for t, m in keys:
    runs = {}  # tool -> rep -> seconds
    for r in rows:
        if (r["target"], r["mode"]) == (t, m) and r["ok"] == "1":
            runs.setdefault(r["tool"], {})[r["rep"]] = float(r["seconds"])
    med = {tool: statistics.median(v.values()) for tool, v in runs.items()}
    f = lambda tool: f"{med[tool]:.3f}" if tool in med else "n/a"
    def ratio(mine, others):
        got = []
        for rep, x in runs.get(mine, {}).items():
            o = [runs[n][rep] for n in others if rep in runs.get(n, {})]
            if o:
                got.append(x / min(o))
        if not got:
            return "n/a"
        return f"{statistics.median(got):.2f} [{min(got):.2f}-{max(got):.2f}]"
    print(f"| {t} | {m} | {f('rawdisk')} | {f('qemu-img-flush')} | {f('nbdcopy-flush')} | "
          f"{ratio('rawdisk', ('qemu-img-flush', 'nbdcopy-flush'))} | {f('rawdisk-noflush')} | "
          f"{f('qemu-img')} | {f('nbdcopy')} | {ratio('rawdisk-noflush', ('qemu-img', 'nbdcopy'))} |")
EOF
echo
log "raw results: $OUT"
