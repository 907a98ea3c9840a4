//! What the in-process server tests share: a [`Server`] serving on a thread
//! of its own until stopped, and the check that the exported file holds
//! exactly its model.
#![allow(dead_code)] // each test file uses a part

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use rawdisk_nbd::server::{Listener, Server, Totals};
use tokio::sync::watch;

/// The raw-bytes client and the temp-file server of the `server_*` tests.
pub mod harness;

/// Where the server listens.
pub enum Bind {
    Unix(PathBuf),
    /// 127.0.0.1 on a free port ([`Running::port`]).
    Tcp,
}

/// A server on its own runtime and thread; dropping it stops it and
/// checks that serve() returned Ok.
pub struct Running {
    stop: Option<watch::Sender<bool>>,
    thread: Option<JoinHandle<io::Result<()>>>,
    /// The TCP port with [`Bind::Tcp`], else 0.
    pub port: u16,
    server: Arc<Server>,
}

impl Running {
    /// On a runtime of two workers, as `rawdisk serve` runs on two CPUs.
    pub fn start(server: Server, bind: Bind) -> Running {
        Running::start_on(server, bind, false)
    }

    /// With `current_thread`, on a single-threaded runtime: the library
    /// may be embedded in one.
    pub fn start_on(server: Server, bind: Bind, current_thread: bool) -> Running {
        let (stop_tx, stop_rx) = watch::channel(false);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let server = Arc::new(server);
        let theirs = server.clone();
        let thread = std::thread::spawn(move || {
            let rt = if current_thread {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?
            } else {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()?
            };
            rt.block_on(async move {
                let (listener, port) = match bind {
                    Bind::Unix(p) => (Listener::Unix(tokio::net::UnixListener::bind(p)?), 0),
                    Bind::Tcp => {
                        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                        let port = l.local_addr()?.port();
                        (Listener::Tcp(l), port)
                    }
                };
                ready_tx.send(port).unwrap();
                theirs.serve(listener, stop_rx).await
            })
        });
        let port = ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the server did not start listening");
        Running {
            stop: Some(stop_tx),
            thread: Some(thread),
            port,
            server,
        }
    }

    /// The server's totals now (what SIGUSR1 logs).
    pub fn totals(&self) -> Totals {
        self.server.totals()
    }

    /// Asks the server to shut down, without waiting for it.
    pub fn request_stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(true);
        }
    }

    /// Stops the server and returns what serve() returned.
    pub fn stop(&mut self) -> io::Result<()> {
        self.request_stop();
        match self.thread.take() {
            Some(t) => t.join().expect("server thread panicked"),
            None => Ok(()),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let r = self.stop();
        if !std::thread::panicking() {
            r.expect("serve() failed");
        }
    }
}

/// The file holds exactly `model`: nothing the requests did not ask for
/// changed.
pub fn assert_file_is(path: &Path, model: &[u8]) {
    let f = std::fs::read(path).unwrap();
    assert_eq!(f.len(), model.len(), "file size changed");
    if let Some(i) = (0..f.len()).find(|&i| f[i] != model[i]) {
        panic!(
            "file differs from the model at byte {i}: {:#x} != {:#x}",
            f[i], model[i]
        );
    }
}
