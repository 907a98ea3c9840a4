//! `serve --log=syslog`: each message one datagram to /dev/log, in the
//! local form syslogd and journald read (`<PRI>rawdisk[PID]: TEXT`).

use std::io;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::sync::Arc;

use tracing_subscriber::fmt::MakeWriter;

/// Facility daemon (3), as nbdkit logs.
const FACILITY: u8 = 3 << 3;

#[derive(Clone)]
pub struct Syslog {
    sock: Option<Arc<UnixDatagram>>,
}

impl Syslog {
    /// Connects to /dev/log; without a system log the messages are lost,
    /// which is said once on stderr when `warn` (--log=syslog was typed).
    pub fn connect(warn: bool) -> Syslog {
        Syslog::connect_to(Path::new("/dev/log"), warn)
    }

    fn connect_to(path: &Path, warn: bool) -> Syslog {
        // Non-blocking: a log that stops reading (its queue full) would
        // otherwise hold the runtime thread that logs, the signal task's too.
        let sock = UnixDatagram::unbound()
            .and_then(|s| s.connect(path).map(|()| s))
            .and_then(|s| s.set_nonblocking(true).map(|()| s));
        match sock {
            Ok(s) => Syslog {
                sock: Some(Arc::new(s)),
            },
            Err(e) => {
                if warn {
                    eprintln!("rawdisk: warning: --log=syslog: /dev/log: {e}; messages are lost");
                }
                Syslog { sock: None }
            }
        }
    }
}

/// One message, sent when the formatter is done with it.
pub struct Line {
    sock: Option<Arc<UnixDatagram>>,
    pri: u8,
    buf: Vec<u8>,
}

impl io::Write for Line {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        let (Some(sock), text) = (&self.sock, self.buf.trim_ascii_end()) else {
            return;
        };
        if text.is_empty() {
            return;
        }
        let mut msg = format!("<{}>rawdisk[{}]: ", self.pri, std::process::id()).into_bytes();
        msg.extend_from_slice(text);
        // A full or absent log loses the line; the server goes on.
        let _ = sock.send(&msg);
    }
}

impl<'a> MakeWriter<'a> for Syslog {
    type Writer = Line;
    fn make_writer(&'a self) -> Line {
        self.line(6)
    }
    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> Line {
        self.line(match *meta.level() {
            tracing::Level::ERROR => 3,
            tracing::Level::WARN => 4,
            tracing::Level::INFO => 6,
            _ => 7,
        })
    }
}

impl Syslog {
    fn line(&self, severity: u8) -> Line {
        Line {
            sock: self.sock.clone(),
            pri: FACILITY | severity,
            buf: Vec::with_capacity(256),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::time::Duration;

    /// A log that reads nothing fills its queue: the lines past that are
    /// lost, and logging never waits (it did, holding a runtime thread).
    #[test]
    fn a_full_log_loses_lines_and_never_blocks() {
        let dir = std::env::temp_dir().join(format!("rawdisk-syslog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("log");
        let _ = std::fs::remove_file(&path);
        let log = UnixDatagram::bind(&path).unwrap();
        let writer = Syslog::connect_to(&path, false);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for i in 0..10_000 {
                let mut line = writer.make_writer();
                writeln!(line, "line {i}").unwrap();
            }
            let _ = tx.send(());
        });
        let done = rx.recv_timeout(Duration::from_secs(20));
        let mut buf = [0u8; 64];
        let n = log.recv(&mut buf).unwrap();
        assert_eq!(
            &buf[..n],
            format!("<30>rawdisk[{}]: line 0", std::process::id()).as_bytes()
        );
        let _ = std::fs::remove_dir_all(&dir);
        assert!(done.is_ok(), "logging blocked on a full log");
    }
}
