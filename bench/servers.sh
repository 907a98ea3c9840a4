# bench/servers.sh -- sourced by the benchmarks: one command line per server
# configuration, so that every table compares the same things.
# serve KIND IMAGE SOCKET starts it in the background, sets pid and returns
# once the socket exists. KIND: rawdisk, rawdisk-direct (--cache none),
# custom:NAME (the binary in $RAWDISK_BIN_NAME), nbdkit (file plugin),
# qemu-nbd (writeback, discard=unmap: qemu-nbd drops trims by default),
# qemu-nbd-direct (O_DIRECT: cache=none, aio=native, discard=unmap),
# nbdkit-memory (a ceiling: nbdkit's memory plugin, IMAGE only sizes it).
# rawdisk's log goes to $SERVER_LOG (default /dev/null).
serve() {
    local v
    rm -f "$3"
    case $1 in
    rawdisk) "$RAWDISK_BIN" serve --socket "$3" "$2" >/dev/null 2>"${SERVER_LOG:-/dev/null}" & ;;
    rawdisk-direct) "$RAWDISK_BIN" serve --cache none --socket "$3" "$2" >/dev/null 2>"${SERVER_LOG:-/dev/null}" & ;;
    custom:*) v=RAWDISK_BIN_${1#custom:}; "${!v}" serve --socket "$3" "$2" >/dev/null 2>"${SERVER_LOG:-/dev/null}" & ;;
    nbdkit) nbdkit -f -U "$3" file "$2" & ;;
    # A ceiling, not an anchor: RAM of the image's size, no file at all
    # (what a client gets from a server that costs nothing).
    nbdkit-memory) nbdkit -f -U "$3" memory "$(stat -c %s "$2")" & ;;
    qemu-nbd) qemu-nbd -t -k "$3" -f raw --cache=writeback --discard=unmap "$2" & ;;
    qemu-nbd-direct) qemu-nbd -t -k "$3" -f raw --cache=none --aio=native --discard=unmap "$2" & ;;
    *) echo "unknown server $1" >&2; return 1 ;;
    esac
    pid=$!
    for _ in $(seq 400); do [ -S "$3" ] && return 0; sleep 0.025; done
    echo "$1 did not start" >&2
    return 1
}
