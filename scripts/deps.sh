#!/usr/bin/env bash
# Installs from Debian's packages what building and testing rawdisk need
# when it is missing: the build's libssl-dev/pkg-config (the openssl crate)
# and the real clients, servers and mkfs tools the tests drive. Run as root
# to install; otherwise it only names what is missing.
# Used by scripts/test.sh and by .ci/run (before clippy builds anything).
set -euo pipefail
export PATH="/usr/sbin:/usr/bin:/sbin:/bin:$PATH"

is_root() { [ "$(id -u)" = 0 ]; }

need=()
want() { command -v "$1" >/dev/null 2>&1 || need+=("$2"); }
want qemu-img qemu-utils
want qemu-io qemu-utils
want qemu-nbd qemu-utils
want nbdinfo libnbd-bin
want nbdsh libnbd-bin
want nbdcopy libnbd-bin
want nbdkit nbdkit
want mkfs.xfs xfsprogs
want mkfs.ext4 e2fsprogs
want mkfs.btrfs btrfs-progs
want losetup util-linux
want blkdiscard util-linux
want fallocate util-linux
want cmp diffutils
# map's tests count its SEEK_DATA/SEEK_HOLE lookups and its peak memory.
want strace strace
want /usr/bin/time time
# The man pages are rendered (man -l) and checked (groff -ww, mandoc -T
# lint); the systemd units and socket-activated --dir run under
# systemd-socket-activate.
want man man-db
want groff groff-base
want mandoc mandoc
want systemd-socket-activate systemd
want systemd-analyze systemd
# TLS: the openssl crate builds against the system's libssl; the tests make
# their certificates with the openssl command.
want openssl openssl
want pkg-config pkg-config
want cc gcc
pkg-config --exists openssl 2>/dev/null || need+=(libssl-dev)
/usr/bin/python3 -c 'import nbd' >/dev/null 2>&1 || need+=(python3-libnbd)
/usr/bin/python3 -m pytest --version >/dev/null 2>&1 || need+=(python3-pytest)
/usr/bin/python3 -c 'import jsonschema' >/dev/null 2>&1 || need+=(python3-jsonschema)
# serve --aio io_uring is tested where seccomp refuses io_uring_setup.
/usr/bin/python3 -c 'import seccomp' >/dev/null 2>&1 || need+=(python3-seccomp)
if [ ${#need[@]} -gt 0 ]; then
    if is_root; then
        echo "deps.sh: installing ${need[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    else
        echo "deps.sh: missing packages (run as root to install): ${need[*]}" >&2
    fi
fi
