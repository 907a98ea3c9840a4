"""scripts/install.sh into a PREFIX: the binary, a man page per command
and nested command that renders and names every option its --help has,
bash completion that parses and completes commands and options, and the
systemd units pointing at the installed binary: system units for a system
PREFIX, user units where `systemctl --user` looks (or a printed way to put
them there) for a PREFIX under the user's home. Also that the top-level
--help lists every command the README names, and not the hidden
generate-docs."""

import os
import pathlib
import re
import shutil
import subprocess

import pytest

import servers

pytestmark = pytest.mark.rawdisk_only("the rawdisk command line")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def rawdisk(*args):
    res = subprocess.run([servers.RAWDISK_BIN, *args], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def commands():
    """The commands `rawdisk --help` lists."""
    out = rawdisk("--help")
    block = out.split("Commands:", 1)[1].split("Options:", 1)[0]
    names = [line.split()[0] for line in block.splitlines() if line.strip()]
    return [n for n in names if n != "help"]


def command_paths(path=()):
    """Every command and nested command: (), ("serve",), ("checkpoint", "create")..."""
    out = rawdisk(*path, "--help")
    paths = [tuple(path)]
    if "\nCommands:\n" in out:
        block = out.split("\nCommands:\n", 1)[1].split("\n\n", 1)[0]
        for line in block.splitlines():
            if line.strip() and line.split()[0] != "help":
                paths += command_paths((*path, line.split()[0]))
    return paths


def long_options(help_text):
    return sorted(set(re.findall(r"^\s+(?:-\w, )?(--[a-z][a-z-]*)", help_text, re.M)))


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    p = tmp_path_factory.mktemp("prefix")
    env = dict(os.environ, PREFIX=str(p), RAWDISK_BIN=os.path.abspath(servers.RAWDISK_BIN))
    res = subprocess.run([os.path.join(ROOT, "scripts", "install.sh")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return str(p)


def test_readme_commands_are_in_help():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    named = set(re.findall(r"^\| `rawdisk ([\w-]+)", readme, re.M))
    assert {"serve", "info", "copy"} <= named, named
    listed = set(commands())
    assert named <= listed, f"README names {named - listed}, --help does not list them"
    assert "generate-docs" not in listed


def test_installs_binary_and_units(prefix):
    binary = os.path.join(prefix, "bin", "rawdisk")
    assert os.access(binary, os.X_OK)
    assert subprocess.run([binary, "--version"], capture_output=True,
                          text=True).stdout.startswith("rawdisk ")
    with open(os.path.join(prefix, "lib", "systemd", "system", "rawdisk@.service")) as f:
        exec_start = [line for line in f if line.startswith("ExecStart=")]
    assert exec_start == [f"ExecStart={binary} serve --export-name %i "
                          "${STATE_DIRECTORY}/%i.img\n"]
    assert os.path.exists(os.path.join(prefix, "lib", "systemd", "system", "rawdisk@.socket"))


def test_man_page_per_command_renders_and_names_its_options(prefix):
    mandir = os.path.join(prefix, "share", "man", "man1")
    pages = sorted(os.listdir(mandir))
    paths = command_paths()
    assert ("checkpoint", "create") in paths
    assert pages == sorted("-".join(("rawdisk", *p)) + ".1" for p in paths)
    for path in paths:
        title = "-".join(("rawdisk", *path))
        page = os.path.join(mandir, f"{title}.1")
        # groff's warnings (-ww) on stderr mean broken roff.
        warn = subprocess.run(["groff", "-ww", "-z", "-man", page], capture_output=True,
                              text=True, timeout=60)
        assert warn.returncode == 0 and warn.stderr == "", (page, warn.stderr)
        env = dict(os.environ, MANWIDTH="100", MAN_KEEP_FORMATTING="0")
        res = subprocess.run(["man", "-l", page], capture_output=True, text=True,
                             env=env, timeout=60)
        assert res.returncode == 0, res.stderr
        text = re.sub(r".\x08", "", res.stdout)
        assert text.lstrip().startswith(f"{title}(1)"), text[:200]
        help_text = rawdisk(*path, "--help")
        opts = long_options(help_text)
        assert "--help" in opts
        for opt in opts:
            assert opt in text, f"{page} does not name {opt}"
        if path:
            words = " ".join(("rawdisk", *path))
            assert "EXAMPLES" in text and words in text.split("EXAMPLES", 1)[1]


def bash_complete(completion_file, words):
    """COMPREPLY of the installed completion for the words typed so far (the
    last one being completed)."""
    script = f"""
source {completion_file}
COMP_WORDS=({' '.join(repr(w) if w else "''" for w in words)})
COMP_CWORD={len(words) - 1}
COMP_LINE="${{COMP_WORDS[*]}}"
COMP_POINT=${{#COMP_LINE}}
_rawdisk rawdisk "${{COMP_WORDS[COMP_CWORD]}}" "${{COMP_WORDS[COMP_CWORD-1]}}"
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    res = subprocess.run(["bash", "--norc", "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


def test_bash_completion(prefix):
    comp = os.path.join(prefix, "share", "bash-completion", "completions", "rawdisk")
    syntax = subprocess.run(["bash", "-n", comp], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    subs = bash_complete(comp, ["rawdisk", ""])
    for c in commands():
        assert c in subs, (c, subs)
    assert "generate-docs" not in subs
    assert bash_complete(comp, ["rawdisk", "ser"]) == ["serve"]
    opts = bash_complete(comp, ["rawdisk", "serve", "--re"])
    assert "--read-only" in opts and "--tls" not in opts, opts
    assert bash_complete(comp, ["rawdisk", "info", "--li"]) == ["--list"]
    assert sorted(bash_complete(comp, ["rawdisk", "map", "--output", ""])) == ["human", "json"]


@pytest.mark.skipif(shutil.which("zsh") is None, reason="needs zsh")
def test_zsh_completion_parses(prefix):
    comp = os.path.join(prefix, "share", "zsh", "site-functions", "_rawdisk")
    res = subprocess.run(["zsh", "-n", comp], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def user_install(home, prefix):
    """install.sh as a user with HOME=home would run it (no XDG overrides)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env.update(HOME=str(home), PREFIX=str(prefix),
               RAWDISK_BIN=os.path.abspath(servers.RAWDISK_BIN))
    res = subprocess.run([os.path.join(ROOT, "scripts", "install.sh")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def user_unit_paths(home):
    """The directories `systemctl --user` loads units from, for HOME=home,
    as systemd itself computes them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env["HOME"] = str(home)
    res = subprocess.run(["systemd-analyze", "--user", "unit-paths"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return [os.path.realpath(p) for p in res.stdout.split()]


def check_user_units(unit_dir, binary):
    with open(os.path.join(unit_dir, "rawdisk@.service")) as f:
        exec_start = [line for line in f if line.startswith("ExecStart=")]
    assert exec_start == [f"ExecStart={binary} serve --export-name %i "
                          "${STATE_DIRECTORY}/%i.img\n"]
    with open(os.path.join(unit_dir, "rawdisk@.socket")) as f:
        listen = [line for line in f if line.startswith("ListenStream=")]
    # A user manager cannot make /run/rawdisk; %t is the user's runtime dir.
    assert listen == ["ListenStream=%t/rawdisk/%i.sock\n"]


def test_home_local_prefix_puts_user_units_where_systemctl_user_looks(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    prefix = home / ".local"
    out = user_install(home, prefix)
    unit_dir = prefix / "share" / "systemd" / "user"
    check_user_units(unit_dir, prefix / "bin" / "rawdisk")
    assert os.path.realpath(unit_dir) in user_unit_paths(home), out
    assert not (prefix / "lib" / "systemd" / "system").exists()
    assert str(unit_dir) in out and "does not look" not in out, out


def test_other_home_prefix_says_how_to_link_the_units(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    prefix = home / "opt" / "rawdisk"
    out = user_install(home, prefix)
    unit_dir = prefix / "lib" / "systemd" / "user"
    check_user_units(unit_dir, prefix / "bin" / "rawdisk")
    searched = user_unit_paths(home)
    assert os.path.realpath(unit_dir) not in searched
    # The printed command links them into a directory systemd searches.
    (hint,) = [line for line in out.splitlines() if "systemctl --user does not look" in line]
    cmd = hint.split(": ", 1)[1]
    config = home / ".config" / "systemd" / "user"
    assert str(config) in cmd and os.path.realpath(config) in searched, (cmd, searched)
    res = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    for name in ("rawdisk@.socket", "rawdisk@.service"):
        assert os.path.samefile(config / name, unit_dir / name)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to run install.sh as another user)")
def test_install_without_root_gets_user_units(workdir):
    """A user without root installing outside their home (a shared
    directory they own) still gets user units, and is told where they went."""
    os.chmod(workdir, 0o755)  # the user (nobody) must reach its directories
    home = pathlib.Path(workdir) / "home"
    prefix = pathlib.Path(workdir) / "shared"
    for d in (home, prefix):
        d.mkdir()
        os.chown(d, 65534, 65534)
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env.update(HOME=str(home), PREFIX=str(prefix),
               RAWDISK_BIN=os.path.abspath(servers.RAWDISK_BIN))
    res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          os.path.join(ROOT, "scripts", "install.sh")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    unit_dir = prefix / "lib" / "systemd" / "user"
    check_user_units(unit_dir, prefix / "bin" / "rawdisk")
    assert not (prefix / "lib" / "systemd" / "system").exists()
    assert f"systemctl --user does not look in {unit_dir}" in res.stdout, res.stdout


DEBUG_INFO = {".debug_info", ".debug_line", ".zdebug_info", ".zdebug_line"}


def debug_sections(path):
    out = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True,
                         check=True).stdout
    return set(re.findall(r"\s(\.(?:z)?debug_\w+|\.gnu_debuglink)\s", out))


def test_installed_binary_has_no_debug_info_and_says_its_size(tmp_path):
    env = dict(os.environ, PREFIX=str(tmp_path / "p"), DESTDIR="", UNITS="system",
               RAWDISK_BIN=servers.RAWDISK_BIN)
    res = subprocess.run([os.path.join(ROOT, "scripts", "install.sh")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    binary = tmp_path / "p" / "bin" / "rawdisk"
    assert not DEBUG_INFO & debug_sections(str(binary))
    assert os.path.getsize(binary) < os.path.getsize(servers.RAWDISK_BIN)
    kib = re.search(r"the binary takes (\d+) KiB", res.stdout)
    assert kib and int(kib.group(1)) == -(-os.stat(binary).st_blocks * 512 // 1024), res.stdout
    assert subprocess.run([str(binary), "--version"], capture_output=True,
                          text=True).stdout.startswith("rawdisk ")


def test_split_debug_keeps_the_debug_info_apart_and_linked(tmp_path):
    env = dict(os.environ, PREFIX="/usr", DESTDIR=str(tmp_path), SPLIT_DEBUG="1",
               RAWDISK_BIN=servers.RAWDISK_BIN)
    res = subprocess.run([os.path.join(ROOT, "scripts", "install.sh")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    binary = tmp_path / "usr" / "bin" / "rawdisk"
    debug = tmp_path / "usr" / "lib" / "debug" / "usr" / "bin" / "rawdisk.debug"
    assert ".gnu_debuglink" in debug_sections(str(binary))
    assert not DEBUG_INFO & debug_sections(str(binary))
    assert DEBUG_INFO & debug_sections(str(debug))
    link = subprocess.run(["objcopy", "--dump-section", ".gnu_debuglink=/dev/stdout",
                           str(binary), "/dev/null"], capture_output=True, check=True).stdout
    assert link.split(b"\0", 1)[0] == b"rawdisk.debug"
