#!/bin/sh
# Installs rawdisk under PREFIX (default /usr/local): the binary, a man page
# per command, bash/zsh/fish completions and the systemd socket + service
# pair (inactive until enabled). The man pages and completions come from the
# binary itself (`rawdisk generate-docs`), so they match its --help.
#
# The units: a system PREFIX gets contrib/systemd's in PREFIX/lib/systemd/system.
# A user's PREFIX (under $HOME, or installing without root) gets
# contrib/systemd/user's, for systemctl --user: in PREFIX/share/systemd/user
# when that is the user's own unit directory (PREFIX=$HOME/.local), else in
# PREFIX/lib/systemd/user with a printed line saying how to link them where
# systemctl --user looks. UNITS=system or UNITS=user overrides the choice;
# DESTDIR (packaging) means system.
#
#   scripts/install.sh                        # builds, then installs into /usr/local
#   PREFIX=$HOME/.local scripts/install.sh
#   DESTDIR=/tmp/pkg PREFIX=/usr scripts/install.sh     # for packaging
#   RAWDISK_BIN=path/to/rawdisk scripts/install.sh       # skip the build
#   SPLIT_DEBUG=1 DESTDIR=/tmp/pkg scripts/install.sh     # debug info apart
#
# The installed binary is stripped of its debug info (the release build keeps
# line tables for backtraces: most of its size). SPLIT_DEBUG=1 keeps them in
# PREFIX/lib/debug/PREFIX/bin/rawdisk.debug, linked by .gnu_debuglink, where
# gdb looks, for packagers who ship a -dbgsym package beside it.
set -eu

PREFIX=${PREFIX:-/usr/local}
DESTDIR=${DESTDIR:-}
root=$(cd "$(dirname "$0")/.." && pwd)

if [ -z "${RAWDISK_BIN:-}" ]; then
    (cd "$root" && cargo build --release --locked -p rawdisk)
    RAWDISK_BIN=$root/target/release/rawdisk
fi

docs=$(mktemp -d)
trap 'rm -rf "$docs"' EXIT
"$RAWDISK_BIN" generate-docs "$docs" >/dev/null

dest=$DESTDIR$PREFIX
if [ -z "${UNITS:-}" ]; then
    UNITS=system
    if [ -z "$DESTDIR" ]; then
        home=$(realpath -m "${HOME:-/nonexistent}")
        case "$(realpath -m "$PREFIX")/" in
        "$home"/*) UNITS=user ;;
        esac
        [ "$(id -u)" = 0 ] || UNITS=user
    fi
fi
hint=
case "$UNITS" in
system)
    units_src=$root/contrib/systemd
    units=$dest/lib/systemd/system
    ;;
user)
    units_src=$root/contrib/systemd/user
    # systemctl --user searches $XDG_DATA_HOME/systemd/user and
    # $XDG_CONFIG_HOME/systemd/user, not PREFIX/lib/systemd/user.
    data_home=${XDG_DATA_HOME:-${HOME:-/nonexistent}/.local/share}
    if [ "$(realpath -m "$PREFIX/share")" = "$(realpath -m "$data_home")" ]; then
        units=$dest/share/systemd/user
    else
        units=$dest/lib/systemd/user
        config=${XDG_CONFIG_HOME:-${HOME:-/nonexistent}/.config}/systemd/user
        hint="systemctl --user does not look in $units; link the units into $config: mkdir -p $config && ln -sf $units/rawdisk@.socket $units/rawdisk@.service $config/"
    fi
    ;;
*)
    echo "install.sh: UNITS must be system or user, not '$UNITS'" >&2
    exit 2
    ;;
esac

install -d "$dest/bin" "$dest/share/man/man1" \
    "$dest/share/bash-completion/completions" "$dest/share/zsh/site-functions" \
    "$dest/share/fish/vendor_completions.d" "$units"
install -m 755 "$RAWDISK_BIN" "$dest/bin/rawdisk"
if [ "${SPLIT_DEBUG:-0}" = 1 ]; then
    debug=$dest/lib/debug$PREFIX/bin
    install -d "$debug"
    objcopy --only-keep-debug "$dest/bin/rawdisk" "$debug/rawdisk.debug"
    chmod 644 "$debug/rawdisk.debug"
    objcopy --strip-debug --add-gnu-debuglink="$debug/rawdisk.debug" "$dest/bin/rawdisk"
else
    strip --strip-debug "$dest/bin/rawdisk"
fi
install -m 644 "$docs"/man1/*.1 "$dest/share/man/man1/"
install -m 644 "$docs/completions/rawdisk.bash" "$dest/share/bash-completion/completions/rawdisk"
install -m 644 "$docs/completions/_rawdisk" "$dest/share/zsh/site-functions/_rawdisk"
install -m 644 "$docs/completions/rawdisk.fish" "$dest/share/fish/vendor_completions.d/rawdisk.fish"
# The units name the binary by its installed path (without DESTDIR).
for unit in "$units_src"/rawdisk@.socket "$units_src"/rawdisk@.service; do
    sed "s|/usr/local/bin/rawdisk|$PREFIX/bin/rawdisk|g" "$unit" >"$units/$(basename "$unit")"
    chmod 644 "$units/$(basename "$unit")"
done
size=$(du -k "$dest/bin/rawdisk" | cut -f1)
echo "installed rawdisk into $dest ($UNITS units in $units; the binary takes $size KiB)"
if [ -n "$hint" ]; then
    echo "$hint"
fi
