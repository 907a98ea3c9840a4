"""Every command's `--output json` against docs/json.md: a JSON Schema per
command in docs/schema/ (no key a schema lacks, none it requires missing),
each schema's keys written down in docs/json.md, kebab-case where no anchor
prints the same thing, and the anchors' own keys and values where one does:
`qemu-img info --output=json` for a file, `nbdinfo --json` for an NBD
export and a listing."""

import json
import os
import re
import subprocess
import time

import jsonschema
import pytest

import servers
import storage
from helpers import KiB, MiB, connect, make_image, read_target, sigusr1_totals

pytestmark = pytest.mark.rawdisk_only("the rawdisk command line")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCHEMA_DIR = os.path.join(ROOT, "docs", "schema")
DOC = os.path.join(ROOT, "docs", "json.md")
# Where an anchor prints the same thing its keys stand as it spells them.
ANCHORED = {"info-nbd"}
KEBAB = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


def schema(name):
    with open(os.path.join(SCHEMA_DIR, name + ".json")) as f:
        return json.load(f)


def valid(name, text):
    """The JSON document `text`, checked against docs/schema/NAME.json."""
    doc = json.loads(text)
    jsonschema.Draft202012Validator(
        schema(name), format_checker=jsonschema.FormatChecker()).validate(doc)
    return doc


def rawdisk(*args, ok=True):
    r = subprocess.run([servers.RAWDISK_BIN, *args], capture_output=True, text=True,
                       timeout=120)
    if ok:
        assert r.returncode == 0, (args, r.stderr)
    return r


def json_of(*args, ok=True):
    return rawdisk(*args, "--output", "json", ok=ok).stdout


def keys(s):
    """Every property name in schema `s`, nested ones included."""
    out = set()
    for k, v in s.get("properties", {}).items():
        out.add(k)
        out |= keys(v)
    if isinstance(s.get("items"), dict):
        out |= keys(s["items"])
    return out


def test_every_schema_is_valid_kebab_case_and_written_down():
    with open(DOC) as f:
        doc = f.read()
    names = sorted(n[:-5] for n in os.listdir(SCHEMA_DIR) if n.endswith(".json"))
    assert len(names) >= 12, names
    for n in names:
        s = schema(n)
        jsonschema.Draft202012Validator.check_schema(s)
        assert f"schema/{n}.json" in doc, f"docs/json.md does not name schema/{n}.json"
        for k in keys(s):
            assert f"`{k}`" in doc, f"{n}: key {k} is not in docs/json.md"
            assert n in ANCHORED or KEBAB.match(k), f"{n}: {k} is not kebab-case"


def test_create_info_map_probe_checksum_resize(workdir):
    path = os.path.join(workdir, "disk.img")
    c = valid("create", json_of("create", "--preallocation", "full", path, "3M"))
    assert (c["filename"], c["virtual-size"], c["method"]) == (path, 3 * MiB, "write-zeros"), c
    assert (c["preallocation"], c["bytes-written"], c["replaced"]) == ("full", 3 * MiB, False), c
    assert os.path.getsize(path) == 3 * MiB

    i = valid("info", json_of("info", path))
    q = json.loads(subprocess.run(["qemu-img", "info", "-f", "raw", "--output=json", path],
                                  capture_output=True, text=True, check=True).stdout)
    # qemu-img's keys, with its values, for what both print.
    for k in ("filename", "format", "virtual-size", "actual-size", "dirty-flag"):
        assert i[k] == q[k], (k, i, q)

    m = valid("map", json_of("map", path))
    assert sum(e["length"] for e in m) == 3 * MiB, m

    p = valid("probe", json_of("probe", path))
    assert (p["filename"], p["virtual-size"]) == (path, 3 * MiB), p

    s = valid("checksum", json_of("checksum", path))
    assert (s["filename"], s["virtual-size"]) == (path, 3 * MiB), s

    r = valid("resize", json_of("resize", path, "4M"))
    assert (r["filename"], r["old-virtual-size"], r["virtual-size"]) == (path, 3 * MiB, 4 * MiB), r
    assert os.path.getsize(path) == 4 * MiB


def test_a_block_device(loop512):
    """The keys only a block device has: device-size, zeroed-with,
    loop-backing-file, queue-limits."""
    c = valid("create", json_of("create", "--zero", loop512, "16M"))
    assert (c["filename"], c["kind"], c["virtual-size"], c["device-size"]) == \
        (loop512, "block", 16 * MiB, 32 * MiB), c
    assert c["zeroed-with"], c
    i = valid("info", json_of("info", loop512))
    assert (i["kind"], i["virtual-size"]) == ("block", 32 * MiB), i
    assert i["loop-backing-file"]["filename"].endswith("loop512.img"), i
    p = valid("probe", json_of("probe", loop512))
    assert p["queue-limits"]["logical-block-size"] == 512, p
    r = valid("resize", json_of("resize", loop512, "32M"))
    assert r["old-virtual-size"] == r["virtual-size"] == 32 * MiB, r


def test_compare_outcome_is_one_string(workdir):
    a, model = make_image(workdir, "a.img", 2 * MiB, seed=91)
    b, _ = make_image(workdir, "b.img", 2 * MiB, seed=91)
    j = valid("compare", json_of("compare", a, b))
    assert j["outcome"] == "identical" and "mismatch-offset" not in j, j
    assert (j["a"], j["b"]) == ({"filename": a, "virtual-size": 2 * MiB},
                                {"filename": b, "virtual-size": 2 * MiB}), j
    with open(b, "r+b") as f:
        f.seek(MiB + 700)
        f.write(bytes([model[MiB + 700] ^ 0xff]))
    j = valid("compare", json_of("compare", a, b, ok=False))
    assert (j["outcome"], j["mismatch-offset"], j["first-byte"]) == \
        ("mismatch", MiB + 512, MiB + 700), j
    os.truncate(b, 3 * MiB)
    j = valid("compare", json_of("compare", "--strict", a, b, ok=False))
    assert (j["outcome"], j["b"]["virtual-size"]) == ("size-mismatch", 3 * MiB), j


def test_copy_summary_and_checkpoints(workdir):
    src, model = make_image(workdir, "src.img", 4 * MiB, seed=92, sparse=True)
    dst = os.path.join(workdir, "dst.img")
    j = valid("copy", json_of("copy", "--verify", src, dst))
    assert (j["source"], j["destination"], j["virtual-size"], j["reconnects"]) == \
        (src, dst, 4 * MiB, 0), j
    moved = j["bytes-written"] + j["bytes-zeroed"] + j["bytes-skipped"] + \
        j["bytes-reflinked"] + j["bytes-copy-file-range"]
    assert moved == 4 * MiB == j["bytes-copied"], j
    # bytes-compared counts what was read on both sides.
    v = j["verified"]
    assert v["bytes-compared"] // 2 + v["bytes-skipped"] == 4 * MiB, j
    with open(dst, "rb") as f:
        assert f.read() == bytes(model)

    # To stdout the data goes; the summary then goes to stderr.
    r = subprocess.run([servers.RAWDISK_BIN, "copy", "--output", "json", src, "-"],
                       capture_output=True, timeout=120)
    assert r.returncode == 0 and r.stdout == bytes(model), r.stderr
    assert valid("copy", r.stderr)["destination"] == "-", r.stderr

    cp = valid("checkpoint-create", json_of("checkpoint", "create", "--name", "monday", src))
    assert (cp["name"], cp["filename"], cp["consistent"], cp["reason"]) == \
        ("monday", src, True, None), cp
    listed = valid("checkpoint-list", json_of("checkpoint", "list", src))
    assert [c["name"] for c in listed] == ["monday"], listed
    assert listed[0]["created"] == cp["created"], (listed, cp)
    human = rawdisk("checkpoint", "list", src).stdout
    assert cp["created"] in human, human


def test_nbd_info_and_list_are_nbdinfos(workdir, serve):
    path, _ = make_image(workdir, "disk.img", 5 * MiB, seed=93)
    stats = os.path.join(workdir, "stats.json")
    srv = serve(path, export_name="disk", extra=["--stats", stats])
    for args in (("info",), ("info", "--list")):
        ours = valid("info-nbd", json_of(*args, srv.uri))
        theirs = json.loads(subprocess.run(["nbdinfo", "--json", *args[1:], srv.uri],
                                           capture_output=True, text=True, check=True).stdout)
        assert (ours["protocol"], ours["TLS"]) == (theirs["protocol"], theirs["TLS"]), ours
        (o,), (t,) = ours["exports"], theirs["exports"]
        assert (o["export-name"], o["uri"], o["export-size"], o["is_read_only"]) == \
            (t["export-name"], t["uri"], t["export-size"], t["is_read_only"]), (o, t)
        # Nothing nbdinfo does not print but the two marked as rawdisk's.
        assert set(o) - set(t) <= {"looks-like"}, (o, t)
        assert set(ours) - set(theirs) <= {"extended-headers"}, (ours, theirs)

    logged = valid("serve-stats", sigusr1_totals(srv))
    # No request in flight: nothing owed.
    assert logged["unanswered"] == [], logged
    assert srv.terminate() == 0, srv.stderr()
    with open(stats) as f:
        final = valid("serve-stats", f.read())
    # No connection after the signal: the same counts, none open now.
    assert final["connections"]["accepted"] == logged["connections"]["accepted"] >= 4, final
    assert final["connections"]["open"] == 0, final



def test_sigusr1_names_the_requests_the_server_owes(workdir, serve):
    """A FLUSH the storage holds (the NFS-like file system, 700 ms per
    operation) is owed on its connection while it waits, and SIGUSR1's
    totals say so; once its reply is in, nothing is owed."""
    if not storage.is_root():
        pytest.skip("mounting the NFS-like file system needs root")
    if (why := storage.fuse_unavailable()):
        pytest.skip(why)
    with storage.nfs_like("nfs3", size_mib=16, latency_us=700_000) as mnt:
        path, model = make_image(mnt, "disk.img", MiB, seed=94)
        srv = serve(path)
        h = connect(srv.uri)
        block = bytes([0x3c]) * 4096
        h.pwrite(block, 8192)
        model[8192:8192 + 4096] = block
        start = time.monotonic()
        cookie = h.aio_flush()
        time.sleep(0.2)
        held = valid("serve-stats", sigusr1_totals(srv))
        assert time.monotonic() - start < 0.7, "the check came after the flush ended"
        assert [u["requests"] for u in held["unanswered"]] == [1], held
        assert held["unanswered"][0]["connection"] >= 1, held
        while not h.aio_command_completed(cookie):
            h.poll(-1)
        assert time.monotonic() - start >= 0.7, "the flush was not held"
        assert valid("serve-stats", sigusr1_totals(srv))["unanswered"] == []
        h.shutdown()
        del h
        assert srv.terminate() == 0, srv.stderr()
        assert read_target(path) == bytes(model)


def test_an_incremental_copy_names_its_checkpoint(workdir, serve):
    src, _ = make_image(workdir, "disk.img", 4 * MiB, seed=94, sparse=True)
    backup = os.path.join(workdir, "backup.img")
    valid("checkpoint-create", json_of("checkpoint", "create", "--name", "c0", src))
    valid("copy", json_of("copy", src, backup))
    srv = serve(src, extra=["--track-changes"])
    h = connect(srv.uri)
    h.pwrite(b"\x77" * (4 * KiB), MiB + 8 * KiB)
    h.flush()
    h.shutdown()
    j = valid("copy", json_of("copy", "--verify", "--changed-since", "c0", srv.uri, backup))
    # One chunk of the default 64 KiB granularity changed.
    assert (j["changed-since"], j["virtual-size"], j["bytes-copied"]) == \
        ("c0", 4 * MiB, 64 * KiB), j
    assert read_target(backup) == read_target(src)
