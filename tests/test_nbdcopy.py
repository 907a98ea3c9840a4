"""nbdcopy with 4 connections and many requests in flight moves every byte
into and out of the export, for a size that is not a multiple of 4096, over a
Unix socket and over TCP."""

import subprocess

import pytest

from helpers import MiB, assert_export_is, assert_target_is, make_image, read_target

SIZE = 40 * MiB + 4096 * 3 + 1237


def nbdcopy(src, dst, *extra):
    res = subprocess.run(["nbdcopy", "--connections", "4", "--requests", "32", *extra, src, dst],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_copy_into_dirty_export(workdir, serve, tcp):
    src, model = make_image(workdir, "src.img", SIZE, seed=51, sparse=True)
    dst, _ = make_image(workdir, "dst.img", SIZE, seed=52)
    srv = serve(dst, tcp=tcp)
    nbdcopy(src, srv.uri)
    assert_export_is(srv.uri, model)
    assert_target_is(dst, model)


def test_copy_random_data_into_export(workdir, serve):
    src, model = make_image(workdir, "src.img", SIZE, seed=53)
    dst, _ = make_image(workdir, "dst.img", SIZE, seed=54, sparse=True)
    srv = serve(dst)
    nbdcopy(src, srv.uri, "--flush")
    assert_target_is(dst, model)


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_copy_out_of_export(workdir, serve, tcp):
    src, model = make_image(workdir, "src.img", SIZE, seed=55, sparse=True)
    srv = serve(src, read_only=True, tcp=tcp)
    out = f"{workdir}/out.img"
    nbdcopy(srv.uri, out)
    assert read_target(out) == model
    assert_target_is(src, model, "source after being copied")


def test_copy_between_two_exports(workdir, serve):
    src, model = make_image(workdir, "src.img", SIZE, seed=56, sparse=True)
    dst, _ = make_image(workdir, "dst.img", SIZE, seed=57)
    a = serve(src, read_only=True)
    b = serve(dst)
    nbdcopy(a.uri, b.uri)
    assert_target_is(dst, model)
    assert_target_is(src, model)
