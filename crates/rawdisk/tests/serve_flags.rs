//! serve's short flags, as users of qemu-nbd and nbdkit type them, checked by
//! serving a file and reading what a client is told.

mod common;
use common::*;

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};

/// Starts `rawdisk serve ARGS` and returns it with the URI it prints once it
/// is accepting.
fn serve(args: &[&str]) -> (Child, String) {
    let mut child = rawdisk()
        .arg("serve")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(!line.is_empty(), "serve {args:?} printed no URI");
    (child, line.trim().to_string())
}

fn stop(mut c: Child) {
    let _ = c.kill();
    let _ = c.wait();
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

#[test]
fn short_flags_of_qemu_nbd_and_nbdkit() {
    let d = tempdir();
    let img = d.path().join("t.img");
    std::fs::write(&img, vec![5u8; 1 << 20]).unwrap();
    let img = img.to_str().unwrap();
    let sock = d.path().join("s.sock");
    let pid = d.path().join("p.pid");
    for sflag in ["-U", "-k"] {
        let (c, uri) = serve(&[
            "-r",
            "-e",
            "foo",
            sflag,
            sock.to_str().unwrap(),
            "-P",
            pid.to_str().unwrap(),
            "-t",
            img,
        ]);
        let pid_text = std::fs::read_to_string(&pid).unwrap();
        assert_eq!(pid_text.trim(), c.id().to_string());
        assert!(uri.starts_with("nbd+unix:///foo?socket="), "{uri}");
        let j = run_rawdisk(&["info", "--output", "json", &uri]).ok().json();
        stop(c);
        let e = &j["exports"][0];
        assert_eq!(e["is_read_only"], true, "{j}");
        assert_eq!(e["export-name"], "foo", "{j}");
        assert_eq!(e["export-size"], 1 << 20, "{j}");
    }
    // --bind PORT alone: loopback; -b/-i HOST with -p PORT.
    for args in [
        vec!["-p".to_string()],
        vec!["--bind".to_string()],
        vec!["-b".to_string(), "127.0.0.1".into(), "-p".into()],
        vec!["-i".to_string(), "127.0.0.1".into(), "-p".into()],
    ] {
        let port = free_port().to_string();
        let mut a: Vec<&str> = args.iter().map(String::as_str).collect();
        a.push(&port);
        a.push(img);
        let (c, uri) = serve(&a);
        let j = run_rawdisk(&["info", "--output", "json", &uri]).ok().json();
        stop(c);
        assert_eq!(uri, format!("nbd://127.0.0.1:{port}/"), "{a:?}");
        assert_eq!(j["exports"][0]["is_read_only"], false, "{j}");
    }
    // A port given twice, and a TCP port with a Unix socket, are usage errors.
    run_rawdisk(&["serve", "-b", "127.0.0.1:1", "-p", "2", img]).fails_one_line(2);
    run_rawdisk(&["serve", "-U", "x.sock", "-p", "2", img]).fails_one_line(2);
    assert_eq!(std::fs::read(img).unwrap(), vec![5u8; 1 << 20]);
}

/// Waits for a process that must end by itself; kills it and fails if it
/// does not within 60 s.
fn wait_ends(mut cmd: std::process::Command) -> i32 {
    let mut c = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    for _ in 0..6000 {
        if let Some(st) = c.try_wait().unwrap() {
            return st.code().unwrap_or(-1);
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    stop(c);
    panic!("serve --run did not stop after its command ended");
}

/// `--run CMD` (nbdkit's): the command gets $uri, the server stops when it
/// exits, and the command's status is the server's.
#[test]
fn run_copies_out_and_stops_with_the_commands_status() {
    let d = tempdir();
    let src = d.path().join("src.img");
    let data: Vec<u8> = (0..3 << 20).map(|i: u32| (i * 7 % 251) as u8).collect();
    std::fs::write(&src, &data).unwrap();
    let out = d.path().join("out.img");
    let sock = d.path().join("r.sock");
    let mut cmd = rawdisk();
    cmd.env("RAWDISK", env!("CARGO_BIN_EXE_rawdisk"))
        .env("OUT", &out)
        .args(["serve", "-r", "-U", sock.to_str().unwrap(), "--run"])
        .arg(r#""$RAWDISK" copy -q "$uri" "$OUT""#)
        .arg(&src);
    assert_eq!(wait_ends(cmd), 0);
    assert_eq!(std::fs::read(&out).unwrap(), data);
    assert_eq!(std::fs::read(&src).unwrap(), data);
    let mut cmd = rawdisk();
    cmd.args(["serve", "-U", sock.to_str().unwrap(), "--run"])
        .arg("test -n \"$uri\" && exit 3")
        .arg(&src);
    assert_eq!(wait_ends(cmd), 3);
}

/// A wrong export name: the error lists what the server offers, and names
/// the URI once.
#[test]
fn wrong_export_name_lists_the_exports() {
    let d = tempdir();
    let img = d.path().join("t.img");
    std::fs::write(&img, vec![1u8; 65536]).unwrap();
    let sock = d.path().join("e.sock");
    let (c, _) = serve(&[
        "-r",
        "-e",
        "foo",
        "-U",
        sock.to_str().unwrap(),
        img.to_str().unwrap(),
    ]);
    let uri = format!("nbd+unix:///bar?socket={}", sock.display());
    let results: Vec<Run> = ["info", "map"]
        .iter()
        .map(|cmd| run_rawdisk(&[cmd, uri.as_str()]))
        .collect();
    stop(c);
    for r in results {
        let r = r.fails_one_line(1);
        assert!(
            r.stderr.contains("the server offers 'foo'"),
            "{:?}",
            r.stderr
        );
        assert_eq!(r.stderr.matches(&uri).count(), 1, "{:?}", r.stderr);
    }
    // Nobody listening: the URI once too.
    let none = format!(
        "nbd+unix:///?socket={}",
        d.path().join("none.sock").display()
    );
    let r = run_rawdisk(&["info", &none]).fails_one_line(1);
    assert_eq!(r.stderr.matches(&none).count(), 1, "{:?}", r.stderr);
}
