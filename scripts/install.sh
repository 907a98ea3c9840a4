#!/bin/sh
# Installs rawdisk under PREFIX (default /usr/local): the binary, a man page
# per command, bash/zsh/fish completions and the systemd socket + service
# pair from contrib/systemd (inactive until enabled). The man pages and
# completions come from the binary itself (`rawdisk generate-docs`), so they
# match its --help.
#
#   scripts/install.sh                        # builds, then installs into /usr/local
#   PREFIX=$HOME/.local scripts/install.sh
#   DESTDIR=/tmp/pkg PREFIX=/usr scripts/install.sh     # for packaging
#   RAWDISK_BIN=path/to/rawdisk scripts/install.sh       # skip the build
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
install -d "$dest/bin" "$dest/share/man/man1" \
    "$dest/share/bash-completion/completions" "$dest/share/zsh/site-functions" \
    "$dest/share/fish/vendor_completions.d" "$dest/lib/systemd/system"
install -m 755 "$RAWDISK_BIN" "$dest/bin/rawdisk"
install -m 644 "$docs"/man1/*.1 "$dest/share/man/man1/"
install -m 644 "$docs/completions/rawdisk.bash" "$dest/share/bash-completion/completions/rawdisk"
install -m 644 "$docs/completions/_rawdisk" "$dest/share/zsh/site-functions/_rawdisk"
install -m 644 "$docs/completions/rawdisk.fish" "$dest/share/fish/vendor_completions.d/rawdisk.fish"
# The units name the binary by its installed path (without DESTDIR).
for unit in "$root"/contrib/systemd/rawdisk@.socket "$root"/contrib/systemd/rawdisk@.service; do
    sed "s|/usr/local/bin/rawdisk|$PREFIX/bin/rawdisk|g" "$unit" >"$dest/lib/systemd/system/$(basename "$unit")"
    chmod 644 "$dest/lib/systemd/system/$(basename "$unit")"
done
echo "installed rawdisk into $dest"
