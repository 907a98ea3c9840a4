//! `nfs-like-fs [--profile nfs3|nfs42] [--latency-us N] [--max-write BYTES]
//! [--threads N] BACKING MOUNTPOINT`: mounts the NFS-like FUSE file system
//! (rawdisk_testkit::nfs_like) and serves it until it is unmounted. Prints
//! `ready` on standard output once the mount is live. Needs root.

use std::path::PathBuf;
use std::time::Duration;

use rawdisk_testkit::nfs_like::{NfsLike, Options, Profile};

fn usage(msg: &str) -> ! {
    eprintln!("nfs-like-fs: {msg}");
    eprintln!("usage: nfs-like-fs [--profile nfs3|nfs42] [--latency-us N] [--max-write BYTES] [--threads N] BACKING MOUNTPOINT");
    std::process::exit(2);
}

fn number(flag: &str, v: Option<String>) -> u64 {
    v.and_then(|s| s.parse().ok())
        .unwrap_or_else(|| usage(&format!("{flag} needs a number")))
}

fn main() {
    let mut opts = Options::new(Profile::Nfs3);
    let mut paths: Vec<PathBuf> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--profile" => {
                let p = args.next().unwrap_or_default();
                opts.profile =
                    Profile::parse(&p).unwrap_or_else(|| usage(&format!("unknown profile {p:?}")));
            }
            "--latency-us" => opts.latency = Duration::from_micros(number(&a, args.next())),
            "--max-write" => {
                opts.max_write = u32::try_from(number(&a, args.next()))
                    .unwrap_or_else(|_| usage("--max-write too large"))
            }
            "--threads" => opts.threads = number(&a, args.next()).max(1) as usize,
            s if s.starts_with("--") => usage(&format!("unknown option {s}")),
            _ => paths.push(a.into()),
        }
    }
    let [backing, mountpoint] =
        <[PathBuf; 2]>::try_from(paths).unwrap_or_else(|_| usage("needs BACKING and MOUNTPOINT"));
    let r = NfsLike::serve(&backing, &mountpoint, opts, || {
        println!("ready");
    });
    if let Err(e) = r {
        eprintln!(
            "nfs-like-fs: mount {} on {}: {e}",
            backing.display(),
            mountpoint.display()
        );
        std::process::exit(1);
    }
}
