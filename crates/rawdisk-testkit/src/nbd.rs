//! [`NbdServer`]: an NBD server process (nbdkit, qemu-nbd, `rawdisk serve`)
//! on a private Unix socket, killed on drop.

use std::path::Path;

/// An NBD server under test or for reference (nbdkit's file plugin, qemu-nbd,
/// `rawdisk serve`), listening on a Unix socket in a private temp dir;
/// killed on Drop.
pub struct NbdServer {
    /// The server process, for tests that kill it on purpose.
    pub child: std::process::Child,
    sock: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

/// Whether a Unix socket bound at `path` is listening: /proc/net/unix
/// lists it with __SO_ACCEPTCON (0x10000) in its flags. Unlike a test
/// connect, this leaves no half-open connection for the server to log.
fn unix_listening(path: &Path) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/net/unix") else {
        return path.exists();
    };
    let want = path.to_string_lossy();
    table.lines().skip(1).any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() >= 8
            && f[7] == want
            && u32::from_str_radix(f[3], 16).is_ok_and(|flags| flags & 0x10000 != 0)
    })
}

impl NbdServer {
    /// Starts `cmd` (which must listen on `sock`) and waits for the socket.
    pub fn spawn(
        mut cmd: std::process::Command,
        dir: tempfile::TempDir,
        sock: std::path::PathBuf,
    ) -> NbdServer {
        use std::process::Stdio;
        use std::time::{Duration, Instant};
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}"));
        let mut s = NbdServer {
            child,
            sock,
            _dir: dir,
        };
        let t0 = Instant::now();
        // The socket file appears at bind(), before listen(): a connect in
        // between is refused. Wait for the kernel to list it as listening.
        while !unix_listening(&s.sock) {
            if let Ok(Some(st)) = s.child.try_wait() {
                panic!("{cmd:?} exited early: {st}");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{cmd:?} did not start"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        s
    }

    fn new_socket() -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("nbd.sock");
        (dir, sock)
    }

    /// nbdkit's file plugin; `filters` go before the plugin, `params` after.
    pub fn nbdkit(file: &Path, filters: &[&str], params: &[&str]) -> NbdServer {
        let (dir, sock) = Self::new_socket();
        let mut c = std::process::Command::new("nbdkit");
        c.args(["-f", "--exit-with-parent", "-U"])
            .arg(&sock)
            .args(filters)
            .arg("file")
            .arg(format!("file={}", file.display()))
            .args(params);
        Self::spawn(c, dir, sock)
    }

    /// qemu-nbd with qemu's defaults (page cache, 8 connections allowed).
    pub fn qemu_nbd(file: &Path) -> NbdServer {
        let (dir, sock) = Self::new_socket();
        let mut c = std::process::Command::new("qemu-nbd");
        c.args(["-f", "raw", "-t", "-e", "8", "--cache=writeback", "-k"])
            .arg(&sock)
            .arg(file);
        Self::spawn(c, dir, sock)
    }

    /// `rawdisk serve` from the binary at `bin`.
    pub fn rawdisk(bin: &Path, file: &Path) -> NbdServer {
        let (dir, sock) = Self::new_socket();
        let mut c = std::process::Command::new(bin);
        c.args(["serve", "--socket"]).arg(&sock).arg(file);
        c.stderr(std::process::Stdio::null());
        Self::spawn(c, dir, sock)
    }

    pub fn socket(&self) -> &Path {
        &self.sock
    }

    /// `nbd+unix:///?socket=PATH`
    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.sock.display())
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
