//! Benchmark (not a test): zero a fully written target on each storage kind,
//! per method through the engine, beside the plain tool on the same storage
//! as the limit; and the capability matrix the engine learns on each kind.
//!
//! Run as root, in release mode (bench/zero-methods.sh does both):
//!
//! ```text
//! cargo run --release -p rawdisk-storage --example zero_bench -- \
//!     [--size 4G] [--reps 3] [--kinds tmpfs,ramfs,ext4,xfs,loop512,loop4k,loop-tmpfs] [--caps-only]
//! ```
//!
//! Every storage kind is built by rawdisk-testkit in RAM (tmpfs-backed), so
//! the numbers are kernel-path costs, not disk costs. For each repetition and
//! variant (the order rotates every repetition): fill the whole target with
//! non-zero data and fsync (untimed), then time the zero (engine: `zero` +
//! `flush` through a fresh `Target`; tools: the process's wall time), then
//! check the result reads zero (first and last MiB and 64 random 64 KiB
//! pieces). Forced methods: the earlier methods of the chain are made to fail
//! with EOPNOTSUPP through `FaultSys`, so the engine falls through to the
//! one measured. Output: markdown on stdout, progress on stderr.

use std::fs::OpenOptions as FsOpen;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rawdisk_storage::fault::FaultSys;
use rawdisk_storage::sys::{CallKind, FallocMode, Sys};
use rawdisk_storage::{Method, OpenOptions, Prealloc, Target, ZeroFlags};
use rawdisk_testkit::{find_nonzero, pattern_vec, Scratch, StorageKind, GIB, MIB};

const TRIM: ZeroFlags = ZeroFlags {
    may_trim: true,
    fast_only: false,
};
const NO_TRIM: ZeroFlags = ZeroFlags {
    may_trim: false,
    fast_only: false,
};
const FAST: ZeroFlags = ZeroFlags {
    may_trim: false,
    fast_only: true,
};

const ZR: [CallKind; 2] = [
    CallKind::Fallocate(FallocMode::ZeroRange { keep_size: true }),
    CallKind::Fallocate(FallocMode::ZeroRange { keep_size: false }),
];
const PUNCH: CallKind = CallKind::Fallocate(FallocMode::PunchHole);
const ALLOC: [CallKind; 2] = [
    CallKind::Fallocate(FallocMode::Allocate),
    CallKind::Fallocate(FallocMode::AllocateKeepSize),
];

#[derive(Clone)]
enum Variant {
    /// Through the engine with these flags; these call kinds fail with EOPNOTSUPP.
    Engine {
        name: &'static str,
        flags: ZeroFlags,
        fail: Vec<CallKind>,
    },
    /// A command line; `{}` in an argument is replaced by the target path.
    Tool {
        name: &'static str,
        argv: Vec<String>,
    },
}

impl Variant {
    fn name(&self) -> &'static str {
        match self {
            Variant::Engine { name, .. } | Variant::Tool { name, .. } => name,
        }
    }
}

fn variants(kind: StorageKind, size: u64) -> Vec<Variant> {
    let e = |name, flags, fail: Vec<CallKind>| Variant::Engine { name, flags, fail };
    let t = |name, argv: &[&str]| Variant::Tool {
        name,
        argv: argv.iter().map(|s| s.to_string()).collect(),
    };
    let len = size.to_string();
    let mib = (size / MIB).to_string();
    let count = format!("count={mib}");
    let mut v = vec![
        e("engine may_trim", TRIM, vec![]),
        e("engine no trim", NO_TRIM, vec![]),
        e("engine fast_only", FAST, vec![]),
    ];
    if kind.is_block() {
        v.push(e(
            "engine forced blkzeroout",
            NO_TRIM,
            [&ZR[..], &[PUNCH]].concat(),
        ));
        v.push(e(
            "engine forced write-zeros",
            NO_TRIM,
            [&ZR[..], &[PUNCH, CallKind::BlkZeroout]].concat(),
        ));
    } else {
        v.push(e("engine forced punch-alloc", NO_TRIM, ZR.to_vec()));
        v.push(e(
            "engine forced write-zeros",
            NO_TRIM,
            [&ZR[..], &[PUNCH], &ALLOC[..]].concat(),
        ));
    }
    v.push(t(
        "fallocate -p (punch)",
        &["fallocate", "-p", "-o", "0", "-l", &len, "{}"],
    ));
    v.push(t(
        "fallocate -z (zero range)",
        &["fallocate", "-z", "-o", "0", "-l", &len, "{}"],
    ));
    if kind.is_block() {
        v.push(t("blkdiscard -z (BLKZEROOUT)", &["blkdiscard", "-z", "{}"]));
    }
    v.push(t(
        "dd bs=1M conv=fsync",
        &[
            "dd",
            "if=/dev/zero",
            "of={}",
            "bs=1M",
            &count,
            "conv=fsync,notrunc",
            "status=none",
        ],
    ));
    v
}

fn open_target(path: &Path, fail: &[CallKind]) -> Target {
    let sys: Arc<dyn Sys> = if fail.is_empty() {
        Arc::new(rawdisk_storage::sys::RealSys)
    } else {
        let f = FaultSys::real();
        for k in fail {
            f.fail_from(*k, 1, libc::EOPNOTSUPP);
        }
        f
    };
    Target::open_with_sys(path, &OpenOptions::default(), sys)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

fn fill(path: &Path, size: u64, buf: &[u8]) {
    let f = FsOpen::new().write(true).open(path).unwrap();
    let mut off = 0;
    while off < size {
        let n = (size - off).min(buf.len() as u64) as usize;
        f.write_all_at(&buf[..n], off).unwrap();
        off += n as u64;
    }
    f.sync_all().unwrap();
}

/// Sampled check that the target reads zero.
fn verify(path: &Path, size: u64, rng: &mut rand::rngs::SmallRng) -> Result<(), String> {
    let mut spots = vec![(0, MIB.min(size)), (size - MIB.min(size), MIB.min(size))];
    for _ in 0..64 {
        let o = rng.gen_range(0..size - 65536) / 512 * 512;
        spots.push((o, 65536));
    }
    for (o, l) in spots {
        if let Some(at) = find_nonzero(path, o, l) {
            return Err(format!("non-zero byte at {at}"));
        }
    }
    Ok(())
}

struct Sample {
    secs: Option<f64>,
    /// CPU seconds (user + system) of the zeroing thread or tool process;
    /// less sensitive than wall time to other load on the machine, but blind
    /// to kernel worker threads (loop devices, writeback).
    cpu: f64,
    note: String,
    alloc_mib: f64,
}

fn rusage(who: libc::c_int) -> f64 {
    // SAFETY: getrusage only writes the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `who` is RUSAGE_THREAD or RUSAGE_CHILDREN.
    let r = unsafe { libc::getrusage(who, &mut ru) };
    assert_eq!(r, 0, "getrusage");
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn run_one(s: &Scratch, v: &Variant, size: u64) -> (Option<f64>, f64, String) {
    let path = s.path();
    match v {
        Variant::Engine { flags, fail, .. } => {
            let t = open_target(path, fail);
            let c0 = rusage(libc::RUSAGE_THREAD);
            let t0 = Instant::now();
            let r = t.zero(0, size, *flags).and_then(|o| t.flush().map(|()| o));
            let el = t0.elapsed().as_secs_f64();
            let cpu = rusage(libc::RUSAGE_THREAD) - c0;
            match r {
                Ok(o) => (
                    Some(el),
                    cpu,
                    o.methods
                        .iter()
                        .map(|m| m.name())
                        .collect::<Vec<_>>()
                        .join("+"),
                ),
                Err(e) if flags.fast_only && e.errno() == Some(libc::EOPNOTSUPP) => {
                    (None, cpu, format!("ENOTSUP in {:.4} s", el))
                }
                Err(e) => (None, cpu, format!("error: {e}")),
            }
        }
        Variant::Tool { argv, .. } => {
            let args: Vec<String> = argv
                .iter()
                .map(|a| a.replace("{}", &path.to_string_lossy()))
                .collect();
            let c0 = rusage(libc::RUSAGE_CHILDREN);
            let t0 = Instant::now();
            let out = Command::new(&args[0])
                .args(&args[1..])
                .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
                .output()
                .unwrap();
            let el = t0.elapsed().as_secs_f64();
            let cpu = rusage(libc::RUSAGE_CHILDREN) - c0;
            if out.status.success() {
                (Some(el), cpu, String::new())
            } else {
                let err = String::from_utf8_lossy(&out.stderr);
                let short = err.lines().next().unwrap_or("").trim().to_string();
                (None, cpu, format!("fails: {short}"))
            }
        }
    }
}

/// Three significant digits: milliseconds matter for the offloads.
fn secs(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v >= 1.0 {
        format!("{v:.2}")
    } else if v >= 0.1 {
        format!("{v:.3}")
    } else if v >= 0.01 {
        format!("{v:.4}")
    } else {
        format!("{v:.5}")
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn parse_size(s: &str) -> u64 {
    let (num, mult) = match s.chars().last() {
        Some('G') | Some('g') => (&s[..s.len() - 1], GIB),
        Some('M') | Some('m') => (&s[..s.len() - 1], MIB),
        _ => (s, 1),
    };
    num.parse::<u64>().expect("size") * mult
}

fn kind_by_name(n: &str) -> StorageKind {
    *StorageKind::ALL
        .iter()
        .find(|k| k.name() == n)
        .unwrap_or_else(|| panic!("unknown kind {n}"))
}

/// What the engine learns on fresh storage of this kind, in the order a
/// server would meet it: may_trim zero, no-trim zero, may_trim zero again,
/// fast zero, trim, extents, falloc preallocation.
fn caps_row(kind: StorageKind) -> Vec<String> {
    let s = Scratch::new(kind, 64 * MIB);
    let t = open_target(s.path(), &[]);
    let fmt = |r: rawdisk_storage::Result<rawdisk_storage::ZeroOutcome>| match r {
        Ok(o) => o
            .methods
            .iter()
            .map(|m| m.name())
            .collect::<Vec<_>>()
            .join("+"),
        Err(e) if e.errno() == Some(libc::EOPNOTSUPP) => "ENOTSUP".into(),
        Err(e) => format!("error {e}"),
    };
    let z1 = fmt(t.zero(0, 8 * MIB, TRIM));
    let z2 = fmt(t.zero(8 * MIB, 8 * MIB, NO_TRIM));
    let z3 = fmt(t.zero(16 * MIB, 8 * MIB, TRIM));
    let fast_adv = t.can_fast_zero();
    let z4 = fmt(t.zero(24 * MIB, 8 * MIB, FAST));
    let trim = match t.trim(32 * MIB, 8 * MIB) {
        Ok(()) => {
            if t.can_trim() {
                "yes"
            } else {
                "no-op (unsupported)"
            }
        }
        Err(_) => "error",
    }
    .to_string();
    let _ = t.extents(0, 64 * MIB, 64);
    let prealloc = if kind.is_block() {
        "n/a".to_string()
    } else {
        let p = s.fs().unwrap().path("prealloc.img");
        std::fs::File::create(&p).unwrap();
        let pt = open_target(&p, &[]);
        match pt.preallocate(16 * MIB, Prealloc::Falloc) {
            Ok(r) => r.method.map(|m| m.name().to_string()).unwrap_or_default(),
            Err(e) => format!("error {e}"),
        }
    };
    let snap = t.caps().snapshot();
    let st = |m: Method| snap.get(m).name().to_string();
    vec![
        kind.name().to_string(),
        z1,
        z2,
        z3,
        z4,
        format!(
            "{} → {}",
            if fast_adv { "yes" } else { "no" },
            if t.can_fast_zero() { "yes" } else { "no" }
        ),
        trim,
        prealloc,
        st(Method::PunchHole),
        st(Method::FallocWriteZeroes),
        st(Method::ZeroRange),
        st(Method::PunchAlloc),
        st(Method::BlkZeroout),
        st(Method::BlkDiscard),
        st(Method::SeekHole),
    ]
}

/// MemAvailable from /proc/meminfo, in bytes.
fn mem_available() -> u64 {
    let m = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    m.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn main() {
    let mut size = 4 * GIB;
    let mut reps = 3usize;
    let mut kinds: Vec<StorageKind> = StorageKind::usable();
    let mut caps_only = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--size" => size = parse_size(&args.next().expect("--size N")),
            "--reps" => reps = args.next().expect("--reps N").parse().expect("reps"),
            "--kinds" => {
                kinds = args
                    .next()
                    .expect("--kinds a,b")
                    .split(',')
                    .map(kind_by_name)
                    .collect()
            }
            "--caps-only" => caps_only = true,
            other => panic!("unknown argument {other}"),
        }
    }
    assert!(rawdisk_testkit::is_root(), "zero_bench needs root");

    println!("## Capabilities the engine learns (fresh storage, 8 MiB requests in this order)\n");
    println!("| storage | zero may_trim | zero no trim | zero may_trim again | zero fast_only | can_fast_zero (before → after) | trim | preallocate falloc | punch-hole | falloc-write-zeroes | zero-range | punch-alloc | blkzeroout | blkdiscard | seek-hole |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for k in &kinds {
        eprintln!("caps: {k}");
        println!("| {} |", caps_row(*k).join(" | "));
    }
    if caps_only {
        return;
    }

    let fillbuf = pattern_vec(0xbe7c, 0, 8 << 20);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
    println!(
        "\n## Zeroing {} GiB of a fully written target ({} repetitions, median [min-max] seconds)\n",
        size as f64 / GIB as f64,
        reps
    );
    for k in &kinds {
        // Every kind lives in RAM: refuse rather than have the OOM killer pick
        // a victim on a shared machine (it did, once, during a 4 GiB run).
        let need = size + size / 4 + GIB;
        let avail = mem_available();
        if avail < need {
            eprintln!(
                "zero_bench: {k}: needs about {} MiB of free RAM, {} MiB available; stopping",
                need / MIB,
                avail / MIB
            );
            std::process::exit(3);
        }
        let room = size + size / 8 + 64 * MIB;
        let s = Scratch::with_room(*k, size, room);
        if *k == StorageKind::LoopTmpfs {
            // Make the loop driver drop its
            // write-zeroes offload now (the first ZERO_RANGE on tmpfs fails), so
            // every run sees the same state.
            let st = Command::new("fallocate")
                .args(["-z", "-o", "0", "-l", "4096"])
                .arg(s.path())
                .status()
                .unwrap();
            assert!(st.success());
            let wz = s.loop_dev().unwrap().queue_attr("write_zeroes_max_bytes");
            eprintln!("loop-tmpfs: write_zeroes_max_bytes now {wz}");
        }
        let vs = variants(*k, size);
        let mut samples: Vec<Vec<Sample>> = vs.iter().map(|_| Vec::new()).collect();
        for rep in 0..reps {
            for j in 0..vs.len() {
                let i = (j + rep * 3) % vs.len();
                let v = &vs[i];
                eprint!("{k} rep {rep} {}: fill", v.name());
                fill(s.path(), size, &fillbuf);
                let (secs, cpu, note) = run_one(&s, v, size);
                let note = match secs {
                    Some(_) => match verify(s.path(), size, &mut rng) {
                        Ok(()) => note,
                        Err(e) => format!("VERIFY FAILED: {e} ({note})"),
                    },
                    None => note,
                };
                eprintln!(" → {secs:?} {note}");
                samples[i].push(Sample {
                    secs,
                    cpu,
                    note,
                    alloc_mib: s.allocated() as f64 / MIB as f64,
                });
            }
        }
        println!("### {k}\n");
        println!(
            "| variant | method used / result | seconds | GiB/s | CPU s | allocated after (MiB) |"
        );
        println!("|---|---|---|---|---|---|");
        for (v, ss) in vs.iter().zip(samples.iter()) {
            let mut t: Vec<f64> = ss.iter().filter_map(|s| s.secs).collect();
            let notes: Vec<&str> = {
                let mut n: Vec<&str> = ss.iter().map(|s| s.note.as_str()).collect();
                n.dedup();
                n
            };
            let note = notes.join("; ");
            let mut alloc: Vec<f64> = ss.iter().map(|s| s.alloc_mib).collect();
            let alloc = median(&mut alloc);
            let mut cpu: Vec<f64> = ss.iter().map(|s| s.cpu).collect();
            let cpu = secs(median(&mut cpu));
            if t.len() == ss.len() && !t.is_empty() {
                let (mn, mx) = (
                    t.iter().cloned().fold(f64::MAX, f64::min),
                    t.iter().cloned().fold(0.0, f64::max),
                );
                let m = median(&mut t);
                println!(
                    "| {} | {} | {} [{}-{}] | {:.1} | {} | {:.0} |",
                    v.name(),
                    if note.is_empty() { "-" } else { &note },
                    secs(m),
                    secs(mn),
                    secs(mx),
                    size as f64 / GIB as f64 / m,
                    cpu,
                    alloc
                );
            } else {
                println!(
                    "| {} | {} | - | - | {} | {:.0} |",
                    v.name(),
                    note,
                    cpu,
                    alloc
                );
            }
        }
        println!();
        drop(s);
    }
}
