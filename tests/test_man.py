"""The man pages `rawdisk generate-docs` writes, checked against the binary
they document: a page for every command and nested command (each page a
SEE ALSO names exists), no mandoc warnings, the sections packagers and
readers expect, a SYNOPSIS naming exactly the flags `--help` lists (each
value with its placeholder), exit statuses the binary really returns, and
README's command table agreeing with `rawdisk --help` and the pages."""

import os
import re
import subprocess

import pytest

import servers

pytestmark = pytest.mark.rawdisk_only("the rawdisk command line")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

# Every page has these; the table below adds the command-specific ones.
SECTIONS = ["NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "EXIT STATUS", "ENVIRONMENT",
            "SEE ALSO"]
EXTRA = {
    "serve": ["SIGNALS", "FILES", "EXAMPLES"],
    "copy": ["SIGNALS", "FILES", "EXAMPLES"],
    "create": ["SIGNALS", "EXAMPLES"],
    "resize": ["SIGNALS", "EXAMPLES"],
    "checkpoint": ["FILES", "EXAMPLES"],
}


def run(*args, check=True):
    res = subprocess.run([servers.RAWDISK_BIN, *args], capture_output=True, text=True,
                         timeout=60)
    if check:
        assert res.returncode == 0, res.stderr
    return res


def help_commands(path):
    """The commands `rawdisk PATH --help` lists (without clap's `help`)."""
    out = run(*path, "--help").stdout
    if "\nCommands:\n" not in out:
        return []
    block = out.split("\nCommands:\n", 1)[1].split("\n\n", 1)[0]
    names = [line.split()[0] for line in block.splitlines() if line.strip()]
    return [n for n in names if n != "help"]


def command_paths(path=()):
    """Every command path, depth first: (), ("serve",), ("checkpoint", "create")..."""
    paths = [tuple(path)]
    for name in help_commands(path):
        paths += command_paths((*path, name))
    return paths


# The command whose arguments are qemu-nbd's, not clap's.
QEMU_NBD = ("qemu-nbd",)


def page_name(path):
    return "-".join(("rawdisk", *path))


def help_options(path):
    """{flag: takes_value} of the Options block of `rawdisk PATH --help`
    (short and long spellings), and the positional names of Arguments."""
    out = run(*path, "--help").stdout
    opts = {}
    block = out.split("\nOptions:\n", 1)[1]
    # "  -U, --socket <PATH>", "      --dir <DIR>", "  -v, --verbose...",
    # "      --map[=<CONTEXT>]", "  -p, --progress[=<FD>]";
    # the text under them is indented further.
    for m in re.finditer(r"^  (?:(-\w)(?:, (--[a-z][a-z-]*))?|    (--[a-z][a-z-]*))"
                         r"(?:\.\.\.)?( \[?<[^>]+>\]?|\[=<[^>]+>\])?", block, re.M):
        short, long, long_only, val = m.groups()
        for f in (short, long, long_only):
            if f:
                opts[f] = bool(val)
    args = []
    if "\nArguments:\n" in out:
        block = out.split("\nArguments:\n", 1)[1].split("\nOptions:\n", 1)[0]
        args = re.findall(r"^ {2}[\[<]([A-Z_]+)[\]>]", block, re.M)
    return opts, args


def roff_sections(text):
    """{title: body} of a page's .SH sections, fonts and escapes removed."""
    plain = re.sub(r"\\f[BIRP]", "", text).replace("\\-", "-").replace("\\%", "")
    plain = plain.replace("\\e", "\\").replace("\\&", "")
    out, cur = {}, None
    for line in plain.splitlines():
        m = re.match(r'\.SH "?([^"]*)"?$', line)
        if m:
            cur = m.group(1)
            out[cur] = []
        elif cur is not None:
            out[cur].append(line)
    return out


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs")
    run("generate-docs", str(d))
    man = d / "man1"
    return {p.name: p.read_text() for p in man.iterdir()}


@pytest.fixture(scope="module")
def paths():
    return command_paths()


def test_a_page_for_every_command_and_nested_command(pages, paths):
    assert ("checkpoint", "create") in paths and ("checkpoint", "delete") in paths
    assert sorted(pages) == sorted(f"{page_name(p)}.1" for p in paths)
    # Every rawdisk page a page refers to is one that was generated.
    for name, text in pages.items():
        for ref in re.findall(r"rawdisk(?:\\-[a-z]+)*(?=\\fR\(1\)| \(1\))", text):
            assert f"{ref.replace(chr(92) + '-', '-')}.1" in pages, (name, ref)


def test_mandoc_lint_has_no_warnings(pages, tmp_path):
    for name, text in pages.items():
        path = tmp_path / name
        path.write_text(text)
        res = subprocess.run(["mandoc", "-T", "lint", "-W", "warning", str(path)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and res.stdout == "" and res.stderr == "", \
            (name, res.stdout, res.stderr)


def test_required_sections(pages, paths):
    for path in paths:
        text = pages[f"{page_name(path)}.1"]
        secs = roff_sections(text)
        want = SECTIONS + EXTRA.get(path[0] if path else "", [])
        for s in want:
            assert s in secs and "".join(secs[s]).strip(), (path, s, list(secs))
        # Each sub page points back at its parent.
        if path:
            assert f"{page_name(path[:-1])} (1)" in " ".join(secs["SEE ALSO"]), path
        assert "RUST_LOG" in "\n".join(secs["ENVIRONMENT"]), path

    serve = {k: "\n".join(v) for k, v in roff_sections(pages["rawdisk-serve.1"]).items()}
    for sig in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "second signal"):
        assert sig in serve["SIGNALS"], sig
    for var in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
        assert var in serve["ENVIRONMENT"], var
    assert ".rawdisk-cbt" in serve["FILES"]
    copy = {k: "\n".join(v) for k, v in roff_sections(pages["rawdisk-copy.1"]).items()}
    for code in ("130", "143"):
        assert f".TP\n{code}\n" in copy["EXIT STATUS"] + "\n", code
        assert code in copy["SIGNALS"]
    for path in [p for p in paths if p[:1] == ("checkpoint",)]:
        secs = roff_sections(pages[f"{page_name(path)}.1"])
        assert "TARGET.rawdisk-cbt" in "\n".join(secs["FILES"]), path


def exit_terms(text):
    lines = roff_sections(text)["EXIT STATUS"]
    return [lines[i + 1] for i, line in enumerate(lines[:-1]) if line == ".TP"]


def test_exit_status_matches_the_binary(pages, paths, tmp_path):
    """A bad command line exits 2 on every command, as each page says; compare
    exits 0 for equal images and 1 for different ones, as its page says."""
    for path in paths:
        res = run(*path, "--no-such-flag", check=False)
        # qemu-nbd's command line keeps qemu-nbd's status for it: 1.
        bad = "1" if path == QEMU_NBD else "2"
        assert res.returncode == int(bad), (path, res.returncode, res.stderr)
        terms = exit_terms(pages[f"{page_name(path)}.1"])
        assert bad in terms and "0" in terms, (path, terms)
    a, b = tmp_path / "a.img", tmp_path / "b.img"
    a.write_bytes(b"\0" * 4096)
    b.write_bytes(b"\0" * 4095 + b"\1")
    assert run("compare", str(a), str(a), check=False).returncode == 0
    assert run("compare", str(a), str(b), check=False).returncode == 1
    assert run("compare", str(a), str(tmp_path / "missing"), check=False).returncode == 2
    page = roff_sections(pages["rawdisk-compare.1"])["EXIT STATUS"]
    body = "\n".join(page)
    assert re.search(r"\.TP\n0\nThe images read the same", body), body
    assert re.search(r"\.TP\n1\nThe images differ", body), body
    assert re.search(r"\.TP\n2\nAn error", body), body


def synopsis_line(text, path):
    """The page's SYNOPSIS line for PATH itself (parent pages also have one
    per nested command and a `COMMAND ...` line)."""
    words = " ".join(("rawdisk", *path)) + " "
    lines = [line for line in roff_sections(text)["SYNOPSIS"] if line != ".br"]

    def own(line):
        rest = line[len(words):]
        return (line.startswith(words) and not rest.startswith("COMMAND")
                and (rest[:1] in ("[", "-") or re.match(r"[A-Z]", rest) is not None))

    mine = [line for line in lines if own(line)]
    assert len(mine) == 1, (path, lines)
    return mine[0][len(words):]


def test_synopsis_names_the_flags_of_help(pages, paths):
    # qemu-nbd's options are getopt's, listed in qemu-nbd's own --help
    # layout and in its page's text, not as clap flags.
    for path in (p for p in paths if p != QEMU_NBD):
        text = pages[f"{page_name(path)}.1"]
        syn = synopsis_line(text, path)
        opts, positionals = help_options(path)
        named = set(re.findall(r"(?:^|[\s\[|])(--?[A-Za-z][\w-]*)", syn))
        assert named == set(opts), (path, named ^ set(opts))
        for flag, takes_value in opts.items():
            after = re.search(re.escape(flag) + r"(?=[\s\]|\[=])(.{0,2})", syn).group(1)
            if takes_value:
                # A placeholder or the values follow: `--socket PATH`,
                # `--cache writeback|none`, `--write-behind[=on|off|auto]`,
                # or, when the short spelling comes first, its long one.
                assert re.match(r" [A-Za-z]|\[=|\|-", after), (path, flag, syn)
            else:
                assert re.match(r"\]|\|-", after), (path, flag, syn)
        for name in positionals:
            assert re.search(rf"(^|[\s\[]){name}(\]|$|\s)", syn), (path, name, syn)


def readme_rows():
    """{command: row text} of README's command table."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    table = readme.split("## Commands", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"^\| `rawdisk ([\w-]+)(.*?)` \|", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_readme_table_agrees_with_help_and_pages(pages, paths):
    rows = readme_rows()
    assert sorted(rows) == sorted(help_commands(())), "README's table vs rawdisk --help"
    for cmd, row in rows.items():
        flags = set(re.findall(r"(?:^|[\s\[|])(--?[A-Za-z][\w-]*)", row.replace("\\|", "|")))
        mine = [p for p in paths if p[:1] == (cmd,)]
        help_text = "\n".join(run(*p, "--help").stdout for p in mine)
        man_text = "\n".join("\n".join(sum(roff_sections(pages[f"{page_name(p)}.1"]).values(),
                                           [])) for p in mine)
        for flag in flags:
            # Short aliases (serve's -k, -i) are named in the option's text.
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), \
                (cmd, flag, "not in --help")
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", man_text), \
                (cmd, flag, "not in the man page")
        # The nested commands of the row are the ones --help lists.
        nested = [p[1] for p in mine if len(p) == 2]
        for sub in nested:
            assert re.search(rf"(?:^|[\s|]){sub}(?:\s|$)", row), (cmd, sub)
