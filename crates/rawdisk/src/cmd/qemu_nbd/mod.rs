//! `rawdisk qemu-nbd ARGS...`, also chosen when the binary is run by the
//! name `qemu-nbd`: qemu-nbd's command line, read as qemu-nbd reads it
//! (getopt_long, `json:` filenames, `--image-opts`, `--object`), turned
//! into `serve`'s flags. What rawdisk does not serve is refused in one line
//! that says to use qemu's qemu-nbd. docs/qemu-nbd.md says what each
//! option becomes.

mod getopt;
mod image;

use std::process::ExitCode;

use getopt::Opt;
use image::{Bad, Flat, Image};

/// Serve a raw image from qemu-nbd's command line, as the stacks that
/// start qemu-nbd type it (oVirt, virtnbdbackup, virt-v2v).
///
/// The arguments are qemu-nbd 10.0's, read as qemu-nbd reads them (short
/// and long forms, unambiguous prefixes, `json:` filenames and
/// `--image-opts` for raw over file or host_device with offset and size,
/// `--object tls-creds-x509|psk`), and served by `rawdisk serve`. The same
/// runs when the binary is invoked by the name `qemu-nbd` (a symlink put
/// first on a stack's PATH). Other formats, drivers and the kernel client
/// (-c, -d) are refused with a pointer to qemu's qemu-nbd; `--version`
/// prints `qemu-nbd 10.0.2 (rawdisk VERSION)`. `rawdisk qemu-nbd --help`
/// lists the options; docs/qemu-nbd.md says what each becomes.
#[derive(clap::Args)]
#[command(disable_help_flag = true, disable_version_flag = true)]
#[command(after_help = OPTIONS)]
pub struct Args {
    /// qemu-nbd's options and FILE.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "QEMU-NBD-ARGS"
    )]
    pub args: Vec<std::ffi::OsString>,
}

/// The qemu-nbd release whose options are followed (`--version`).
pub const QEMU_NBD_RELEASE: &str = "10.0.2";

/// What the command line asks for.
pub enum Outcome {
    /// Exit now with this status (help, version, an error said already).
    Exit(ExitCode),
    /// Serve with these flags; `verbose` as `-v` counts.
    Serve(Box<crate::cmd::serve::Args>, u8),
}

/// qemu-nbd exits 1 for every bad command line.
const FAILED: u8 = 1;

const fn o(long: &'static str, short: Option<char>, value: bool) -> Opt {
    Opt { long, short, value }
}

/// qemu-nbd 10.0's options (qemu-nbd.c: "hVb:o:p:rsnc:dvk:e:f:tl:x:T:D:AB:L").
const TABLE: &[Opt] = &[
    o("help", Some('h'), false),
    o("version", Some('V'), false),
    o("bind", Some('b'), true),
    o("port", Some('p'), true),
    o("socket", Some('k'), true),
    o("offset", Some('o'), true),
    o("read-only", Some('r'), false),
    o("allocation-depth", Some('A'), false),
    o("bitmap", Some('B'), true),
    o("connect", Some('c'), true),
    o("disconnect", Some('d'), false),
    o("list", Some('L'), false),
    o("snapshot", Some('s'), false),
    o("load-snapshot", Some('l'), true),
    o("nocache", Some('n'), false),
    o("cache", None, true),
    o("aio", None, true),
    o("discard", None, true),
    o("detect-zeroes", None, true),
    o("shared", Some('e'), true),
    o("format", Some('f'), true),
    o("persistent", Some('t'), false),
    o("verbose", Some('v'), false),
    o("object", None, true),
    o("export-name", Some('x'), true),
    o("description", Some('D'), true),
    o("tls-creds", None, true),
    o("tls-hostname", None, true),
    o("tls-authz", None, true),
    o("image-opts", None, false),
    o("trace", Some('T'), true),
    o("fork", None, false),
    o("pid-file", None, true),
    o("selinux-label", None, true),
    o("handshake-limit", None, true),
];

/// NBD's longest string (export names, descriptions).
const MAX_STRING: usize = 4096;

/// A failure: `Other` is said with the pointer to qemu's qemu-nbd.
enum Fail {
    Usage(String),
    Other(String),
}

impl From<Bad> for Fail {
    fn from(b: Bad) -> Fail {
        match b {
            Bad::Invalid(m) => Fail::Usage(m),
            Bad::Other(m) => Fail::Other(m),
        }
    }
}

/// The options as qemu-nbd keeps them while it reads the command line.
#[derive(Default)]
struct Seen {
    snapshot: bool,
    cache: Option<&'static str>,
    aio: Option<String>,
    discard_unmap: Option<bool>,
    detect_zeroes: Option<&'static str>,
    bind: Option<String>,
    port: Option<String>,
    offset: u64,
    read_only: bool,
    bitmaps: Vec<String>,
    socket: Option<String>,
    shared: Option<u32>,
    format: Option<String>,
    persistent: bool,
    verbose: u8,
    objects: Vec<Flat>,
    export_name: Option<String>,
    description: Option<String>,
    tls_creds: Option<String>,
    tls_hostname: bool,
    tls_authz: bool,
    image_opts: bool,
    fork: bool,
    pid_file: Option<String>,
    handshake_limit: Option<u32>,
}

/// Reads qemu-nbd's command line (`args` without the program name); `prog`
/// is the name messages start with.
pub fn parse(prog: &str, args: &[std::ffi::OsString]) -> Outcome {
    match read(prog, args) {
        Ok(o) => o,
        Err(Fail::Usage(m)) => {
            eprintln!("{prog}: {m} (see '{prog} --help')");
            Outcome::Exit(ExitCode::from(FAILED))
        }
        Err(Fail::Other(m)) => {
            eprintln!(
                "{prog}: {m}: rawdisk serves raw images over files and block devices; \
                 use qemu's qemu-nbd for this"
            );
            Outcome::Exit(ExitCode::from(FAILED))
        }
    }
}

fn read(prog: &str, args: &[std::ffi::OsString]) -> Result<Outcome, Fail> {
    match flags(prog, args)? {
        Flags::Exit(c) => Ok(Outcome::Exit(c)),
        Flags::Serve(argv, verbose) => Ok(Outcome::Serve(Box::new(serve_args(argv)?), verbose)),
    }
}

/// The command line as serve's flags.
enum Flags {
    Exit(ExitCode),
    Serve(Vec<String>, u8),
}

fn flags(prog: &str, args: &[std::ffi::OsString]) -> Result<Flags, Fail> {
    let args: Vec<String> = args
        .iter()
        .map(|a| {
            a.to_str().map(str::to_string).ok_or_else(|| {
                Fail::Usage(format!("argument {a:?} is not UTF-8, which rawdisk needs"))
            })
        })
        .collect::<Result<_, _>>()?;
    let posix = std::env::var_os("POSIXLY_CORRECT").is_some();
    let parsed = getopt::parse(&args, TABLE, posix).map_err(Fail::Usage)?;
    let mut s = Seen::default();
    for (name, value) in parsed.opts {
        let v = value.unwrap_or_default();
        match name {
            "help" => {
                print!("{}", help(prog));
                return Ok(Flags::Exit(ExitCode::SUCCESS));
            }
            "version" => {
                print!("{}", version(prog));
                return Ok(Flags::Exit(ExitCode::SUCCESS));
            }
            "snapshot" => s.snapshot = true,
            "nocache" | "cache" => {
                if s.cache.is_some() {
                    return Err(Fail::Usage(
                        "-n and --cache can only be specified once".into(),
                    ));
                }
                s.cache = Some(match (name, v.as_str()) {
                    ("nocache", _) | (_, "none" | "off") => "none",
                    // unsafe drops flushes; honouring them is the safe side.
                    (_, "writeback" | "unsafe") => "writeback",
                    (_, "writethrough" | "directsync") => {
                        return Err(Fail::Other(format!(
                            "--cache={v} (a sync after each write)"
                        )))
                    }
                    _ => return Err(Fail::Usage(format!("Invalid cache mode `{v}'"))),
                });
            }
            "aio" => {
                if s.aio.is_some() {
                    return Err(Fail::Usage("--aio can only be specified once".into()));
                }
                if !matches!(v.as_str(), "native" | "threads" | "io_uring") {
                    return Err(Fail::Usage(format!("Invalid aio mode '{v}'")));
                }
                s.aio = Some(v);
            }
            "discard" => {
                if s.discard_unmap.is_some() {
                    return Err(Fail::Usage("--discard can only be specified once".into()));
                }
                s.discard_unmap = Some(match v.as_str() {
                    "ignore" | "off" => false,
                    "unmap" | "on" => true,
                    _ => return Err(Fail::Usage(format!("Invalid discard mode `{v}'"))),
                });
            }
            "detect-zeroes" => {
                let mode = match v.as_str() {
                    "off" => "off",
                    "on" => "on",
                    "unmap" => "unmap",
                    _ => {
                        return Err(Fail::Usage(format!(
                            "Failed to parse detect_zeroes mode: Parameter 'detect-zeroes' \
                             does not accept value '{v}'"
                        )))
                    }
                };
                // qemu checks against the --discard given so far.
                if mode == "unmap" && s.discard_unmap != Some(true) {
                    return Err(Fail::Usage(
                        "setting detect-zeroes to unmap is not allowed without setting \
                         discard operation to unmap"
                            .into(),
                    ));
                }
                s.detect_zeroes = Some(mode);
            }
            "bind" => s.bind = Some(v),
            "port" => s.port = Some(v),
            "offset" => {
                s.offset = image::strtou64(&v)
                    .ok_or_else(|| Fail::Usage(format!("Invalid offset '{v}'")))?
            }
            "load-snapshot" => return Err(Fail::Other(format!("-l {v} (an internal snapshot)"))),
            "read-only" => s.read_only = true,
            // serve offers qemu:allocation-depth always.
            "allocation-depth" => {}
            "bitmap" => s.bitmaps.push(v),
            "socket" => {
                if !v.starts_with('/') {
                    return Err(Fail::Usage("socket path must be absolute".into()));
                }
                s.socket = Some(v);
            }
            "disconnect" => return Err(Fail::Other("-d (the kernel's NBD client)".into())),
            "connect" => return Err(Fail::Other(format!("-c {v} (the kernel's NBD client)"))),
            "shared" => {
                let n = strtoi(&v)
                    .ok_or_else(|| Fail::Usage(format!("Invalid shared device number '{v}'")))?;
                s.shared = Some(n);
            }
            "format" => s.format = Some(v),
            "persistent" => s.persistent = true,
            "export-name" => {
                if v.len() > MAX_STRING {
                    return Err(Fail::Usage(format!("export name '{v}' too long")));
                }
                s.export_name = Some(v);
            }
            "description" => {
                if v.len() > MAX_STRING {
                    return Err(Fail::Usage(format!("export description '{v}' too long")));
                }
                s.description = Some(v);
            }
            "verbose" => s.verbose = 1,
            "object" => s.objects.push(object(&v)?),
            "tls-creds" => s.tls_creds = Some(v),
            "tls-hostname" => s.tls_hostname = true,
            "tls-authz" => s.tls_authz = true,
            "image-opts" => s.image_opts = true,
            // qemu's trace events; rawdisk's log is -v.
            "trace" => {}
            "fork" => s.fork = true,
            "list" => {
                return Err(Fail::Other(
                    "-L (listing another server's exports: 'rawdisk info --list' does it)".into(),
                ))
            }
            "pid-file" => s.pid_file = Some(v),
            "selinux-label" => {
                return Err(Fail::Usage(
                    "SELinux support not enabled in this binary".into(),
                ))
            }
            "handshake-limit" => {
                s.handshake_limit = Some(
                    strtoi(&v)
                        .ok_or_else(|| Fail::Usage(format!("Invalid handshake limit '{v}'")))?,
                )
            }
            _ => unreachable!("every option of the table is matched"),
        }
    }
    let [file] = parsed.operands.as_slice() else {
        return Err(Fail::Usage("Invalid number of arguments".into()));
    };
    let img = if s.image_opts {
        image::from_options(&image::key_values(file, None)?)?
    } else if let Some(j) = file.strip_prefix("json:") {
        image::from_options(&image::json_options(j)?)?
    } else {
        image::from_name(file)?
    };
    Ok(Flags::Serve(translate(&s, &img)?, s.verbose))
}

/// qemu_strtoi for counts: blanks before, base 0, not negative.
fn strtoi(v: &str) -> Option<u32> {
    image::strtou64(v).and_then(|n| u32::try_from(n).ok())
}

/// `--object TYPE,id=ID,...` (or its JSON form).
fn object(v: &str) -> Result<Flat, Fail> {
    let flat = match v.trim_start().starts_with('{') {
        true => image::json_options(v)?,
        false => image::key_values(v, Some("qom-type"))?,
    };
    if !flat.contains_key("id") {
        return Err(Fail::Usage(format!(
            "Parameter 'id' is missing in --object {v}"
        )));
    }
    Ok(flat)
}

/// serve's flags for what was given.
fn translate(s: &Seen, img: &Image) -> Result<Vec<String>, Fail> {
    let mut a: Vec<String> = Vec::new();
    let mut flag = |f: &str, v: Option<&str>| match v {
        Some(v) => a.push(format!("--{f}={v}")),
        None => a.push(format!("--{f}")),
    };
    match (&s.socket, &s.bind, &s.port) {
        (Some(sock), _, _) => flag("socket", Some(sock)),
        (None, bind, port) => {
            // qemu-nbd listens on every interface by default.
            flag("bind", Some(bind.as_deref().unwrap_or("0.0.0.0")));
            if let Some(p) = port {
                let n: u16 = p.trim().parse().map_err(|_| {
                    Fail::Usage(format!("invalid port '{p}' (a number from 0 to 65535)"))
                })?;
                flag("port", Some(&n.to_string()));
            }
        }
    }
    flag("export-name", Some(s.export_name.as_deref().unwrap_or("")));
    if let Some(d) = &s.description {
        flag("description", Some(d));
    }
    if s.read_only || img.read_only {
        flag("read-only", None);
    }
    // qemu-nbd: one client at a time unless -e; 0 is no limit.
    flag("shared", Some(&s.shared.unwrap_or(1).to_string()));
    if s.persistent {
        flag("persistent", None);
    } else {
        flag("exit-last", None);
    }
    let cache = match (s.cache, img.direct) {
        (Some(c), _) => c,
        (None, true) => "none",
        (None, false) => "writeback",
    };
    flag("cache", Some(cache));
    if let Some(aio) = s.aio.as_deref().or(img.aio.as_deref()) {
        flag("aio", Some(aio));
    }
    // qemu-nbd ignores discards unless told (rawdisk's default is unmap).
    let unmap = s
        .discard_unmap
        .or_else(|| img.discard.as_deref().map(|d| matches!(d, "unmap" | "on")))
        .unwrap_or(false);
    flag("discard", Some(if unmap { "unmap" } else { "ignore" }));
    if let Some(z) = s
        .detect_zeroes
        .or(img.detect_zeroes.as_deref().and_then(|z| match z {
            "off" => Some("off"),
            "on" => Some("on"),
            "unmap" => Some("unmap"),
            _ => None,
        }))
    {
        flag("detect-zeroes", Some(z));
    }
    if s.fork {
        flag("fork", None);
        // qemu-nbd's daemon keeps reporting to the caller's stderr.
        flag("log", Some("stderr"));
    }
    if let Some(p) = &s.pid_file {
        flag("pid-file", Some(p));
    }
    if let Some(h) = s.handshake_limit {
        // 0: no limit.
        let secs = if h == 0 { 1_000_000_000 } else { h };
        flag("handshake-timeout", Some(&secs.to_string()));
    }
    if s.snapshot {
        flag("snapshot", None);
    }
    for b in &s.bitmaps {
        flag("bitmap", Some(b));
    }
    tls(s, &mut flag)?;
    let format_raw = match s.format.as_deref() {
        Some("raw") => true,
        Some(f) => return Err(Fail::Other(format!("format '{f}'"))),
        None => img.raw,
    };
    if format_raw {
        flag("format", Some("raw"));
    }
    check_protocol(img)?;
    let offset = img
        .offset
        .checked_add(s.offset)
        .ok_or_else(|| Fail::Usage(format!("Invalid offset '{}'", s.offset)))?;
    if offset > 0 {
        flag("offset", Some(&offset.to_string()));
    }
    // qemu-nbd's -o is a raw node over the image: a sized slice loses its
    // first OFFSET bytes and still ends where it did.
    if let Some(size) = img.size {
        let left = size.checked_sub(s.offset).ok_or_else(|| {
            Fail::Usage(format!(
                "Offset ({}) cannot be greater than size of the containing file ({size})",
                s.offset
            ))
        })?;
        flag("size", Some(&left.to_string()));
    }
    a.push("--".into());
    a.push(img.path.clone());
    Ok(a)
}

/// --tls-creds ID naming an `--object tls-creds-x509|psk`.
fn tls(s: &Seen, flag: &mut impl FnMut(&str, Option<&str>)) -> Result<(), Fail> {
    let Some(id) = &s.tls_creds else {
        let given = [
            (s.tls_authz, "--tls-authz"),
            (s.tls_hostname, "--tls-hostname"),
        ];
        return match given.iter().find(|(g, _)| *g) {
            Some((_, f)) => Err(Fail::Usage(format!(
                "{f} is not permitted without --tls-creds"
            ))),
            None => Ok(()),
        };
    };
    if s.socket.is_some() {
        return Err(Fail::Usage("TLS is only supported with IPv4/IPv6".into()));
    }
    if s.tls_hostname {
        return Err(Fail::Usage(
            "TLS hostname is only supported with export list".into(),
        ));
    }
    if s.tls_authz {
        return Err(Fail::Other(
            "--tls-authz (client authorization lists)".into(),
        ));
    }
    let Some(obj) = s.objects.iter().find(|o| o.get("id") == Some(id)) else {
        return Err(Fail::Usage(format!(
            "Failed to get TLS creds: No TLS credentials with id '{id}'"
        )));
    };
    let kind = obj.get("qom-type").map(String::as_str).unwrap_or("");
    if !kind.starts_with("tls-creds") {
        return Err(Fail::Usage(format!(
            "Failed to get TLS creds: Object with id '{id}' is not TLS credentials"
        )));
    }
    if obj.get("endpoint").map_or("client", String::as_str) != "server" {
        return Err(Fail::Usage(
            "Failed to get TLS creds: Expecting TLS credentials with a server endpoint".into(),
        ));
    }
    for k in obj.keys() {
        if !matches!(
            k.as_str(),
            "qom-type" | "id" | "endpoint" | "dir" | "verify-peer" | "priority" | "sanity-check"
        ) {
            return Err(Fail::Other(format!("--object {kind}: option '{k}'")));
        }
    }
    let dir = obj
        .get("dir")
        .ok_or_else(|| Fail::Usage(format!("--object {kind},id={id}: rawdisk needs dir=DIR")))?;
    match kind {
        "tls-creds-x509" => {
            flag("tls-certificates", Some(dir));
            // qemu's x509 credentials check the peer unless told not to.
            let verify = match obj.get("verify-peer").map(String::as_str) {
                None => true,
                Some(v) => matches!(v, "on" | "true" | "yes"),
            };
            if verify {
                flag("tls-verify-peer", None);
            }
        }
        "tls-creds-psk" => flag("tls-psk", Some(&format!("{dir}/keys.psk"))),
        other => return Err(Fail::Other(format!("--object {other}"))),
    }
    Ok(())
}

/// qemu's `file` driver opens regular files, `host_device` block devices.
fn check_protocol(img: &Image) -> Result<(), Fail> {
    use std::os::unix::fs::FileTypeExt;
    let Some(p) = img.protocol else {
        return Ok(());
    };
    // A missing file is the open's to report.
    let Ok(md) = std::fs::metadata(&img.path) else {
        return Ok(());
    };
    let block = md.file_type().is_block_device();
    match p {
        // qemu also takes character devices here; rawdisk serves block
        // devices and files only, so the message names what it takes.
        "host_device" if !block => Err(Fail::Usage(format!(
            "'host_device' driver requires '{}' to be a block device \
             (rawdisk serves no character device)",
            img.path
        ))),
        "file" if block => Err(Fail::Usage(format!(
            "'file' driver requires '{}' to be a regular file; use host_device for a block device",
            img.path
        ))),
        _ => Ok(()),
    }
}

/// The serve command's clap definition.
fn serve_command() -> clap::Command {
    <crate::cmd::serve::Args as clap::Args>::augment_args(
        clap::Command::new("serve").no_binary_name(true),
    )
}

/// serve's Args from its flags.
fn serve_args(argv: Vec<String>) -> Result<crate::cmd::serve::Args, Fail> {
    use clap::FromArgMatches;
    let m = serve_command()
        .try_get_matches_from(&argv)
        .map_err(|e| Fail::Usage(first_line(&e.render().to_string())))?;
    crate::cmd::serve::Args::from_arg_matches(&m)
        .map_err(|e| Fail::Usage(first_line(&e.render().to_string())))
}

fn first_line(s: &str) -> String {
    s.lines()
        .next()
        .unwrap_or("")
        .trim_start_matches("error: ")
        .to_string()
}

/// `--version`: qemu-nbd's first line (stacks parse `qemu-nbd X.Y.Z`).
fn version(prog: &str) -> String {
    let name = std::path::Path::new(prog)
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| *n == "qemu-nbd")
        .unwrap_or("qemu-nbd");
    format!(
        "{name} {QEMU_NBD_RELEASE} (rawdisk {})\n\
         rawdisk serving qemu-nbd {QEMU_NBD_RELEASE}'s command line: raw images over files \
         and block devices.\n",
        env!("CARGO_PKG_VERSION")
    )
}

fn help(prog: &str) -> String {
    format!(
        "Usage: {prog} [OPTIONS] FILE\n\
rawdisk serving qemu-nbd's command line: raw images over files and block\n\
devices, through 'rawdisk serve' (docs/qemu-nbd.md). Other formats, drivers\n\
and the kernel client (-c, -d) need qemu's qemu-nbd.\n\n{OPTIONS}\n"
    )
}

/// qemu-nbd's options as rawdisk takes them (`--help`, the man page).
const OPTIONS: &str = "\
  -h, --help                display this help and exit
  -V, --version             output version information and exit

Connection properties:
  -p, --port=PORT           port to listen on (default `10809')
  -b, --bind=IFACE          interface to bind to (default `0.0.0.0')
  -k, --socket=PATH         path to the unix socket
  -e, --shared=NUM          device can be shared by NUM clients (default '1')
  -t, --persistent          don't exit on the last connection
  -v, --verbose             display extra debugging information
  -x, --export-name=NAME    expose export by name (default is empty string)
  -D, --description=TEXT    export a human-readable description
      --handshake-limit=N   seconds a client has for the handshake (0: no limit)

Exposing part of the image:
  -o, --offset=OFFSET       offset into the image
  -A, --allocation-depth    expose the allocation depth
  -B, --bitmap=NAME         expose a changed-block checkpoint as a dirty bitmap

General purpose options:
  --object type,id=ID,...   tls-creds-x509 or tls-creds-psk (server endpoint)
  --tls-creds=ID            use id of an earlier --object to provide TLS
  -T, --trace ...           accepted; rawdisk's log is -v
  --fork                    fork off the server process and exit the parent
                            once the server is running
  --pid-file=PATH           store the server's process ID in the given file

Block device options:
  -f, --format=FORMAT       raw only
  -r, --read-only           export read-only
  -s, --snapshot            writes go to a private copy, discarded at exit
  -n, --nocache             disable host cache
      --cache=MODE          none, writeback (default) or unsafe
      --aio=MODE            set AIO mode (native, io_uring or threads)
      --discard=MODE        set discard mode (ignore, unmap)
      --detect-zeroes=MODE  set detect-zeroes mode (off, on, unmap)
      --image-opts          treat FILE as a full set of image options

Examples:
  rawdisk qemu-nbd -t --shared=0 --discard=unmap --socket /run/v2v.sock --format raw vm.img
  ln -s \"$(command -v rawdisk)\" /usr/local/bin/qemu-nbd   # the stacks find rawdisk";

#[cfg(test)]
mod tests {
    use super::*;

    fn serve_flags(argv: &[&str]) -> Result<Vec<String>, String> {
        let os: Vec<std::ffi::OsString> = argv.iter().map(|s| s.into()).collect();
        match flags("qemu-nbd", &os) {
            Ok(Flags::Serve(f, _)) => {
                // What serve itself takes.
                serve_args(f.clone()).map_err(|_| format!("serve refused {f:?}"))?;
                Ok(f)
            }
            Ok(Flags::Exit(_)) => Err("exit".into()),
            Err(Fail::Usage(m) | Fail::Other(m)) => Err(m),
        }
    }

    fn has(f: &[String], want: &[&str]) {
        for w in want {
            assert!(f.iter().any(|x| x == w), "{w} not in {f:?}");
        }
    }

    #[test]
    fn the_stacks_command_lines_are_taken() {
        let json =
            r#"json:{"driver": "raw", "file": {"driver": "file", "filename": "/nonexistent/x"}}"#;
        let f = serve_flags(&[
            "--socket",
            "/s",
            "--persistent",
            "--shared=8",
            "--export-name=",
            "--cache=none",
            "--aio=native",
            "--discard=unmap",
            "--detect-zeroes=unmap",
            json,
        ])
        .unwrap();
        has(
            &f,
            &[
                "--socket=/s",
                "--persistent",
                "--shared=8",
                "--export-name=",
                "--cache=none",
                "--aio=native",
                "--discard=unmap",
                "--detect-zeroes=unmap",
                "--format=raw",
                "/nonexistent/x",
            ],
        );
        let f = serve_flags(&[
            "-r",
            "--format=raw",
            "-x",
            "sda",
            "/f",
            "-k",
            "/s",
            "-t",
            "-e 2",
            "--fork",
            "--detect-zeroes=on",
            "--pid-file=/p",
            "--",
        ])
        .unwrap();
        has(
            &f,
            &[
                "--read-only",
                "--format=raw",
                "--export-name=sda",
                "--socket=/s",
                "--persistent",
                "--shared=2",
                "--fork",
                "--detect-zeroes=on",
                "--pid-file=/p",
                "--discard=ignore",
            ],
        );
        let f = serve_flags(&[
            "-t",
            "--shared=0",
            "--discard=unmap",
            "--pid-file",
            "/p",
            "--socket",
            "/s",
            "-s",
            "--format",
            "raw",
            "/f",
        ])
        .unwrap();
        has(
            &f,
            &[
                "--shared=0",
                "--discard=unmap",
                "--pid-file=/p",
                "--snapshot",
            ],
        );
        // qemu-nbd's defaults: every interface, one client, exit after it.
        let f = serve_flags(&["-o", "0x200", "/f"]).unwrap();
        has(
            &f,
            &[
                "--bind=0.0.0.0",
                "--shared=1",
                "--exit-last",
                "--offset=512",
            ],
        );
    }

    #[test]
    fn what_rawdisk_does_not_serve_is_refused() {
        for (argv, want) in [
            (vec!["-f", "qcow2", "/f"], "format 'qcow2'"),
            (vec!["-c", "/dev/nbd0", "/f"], "-c /dev/nbd0"),
            (
                vec!["--detect-zeroes=unmap", "--discard=unmap", "/f"],
                "detect-zeroes to unmap",
            ),
            (vec!["-k", "rel.sock", "/f"], "socket path must be absolute"),
            (vec!["-e", "x", "/f"], "Invalid shared device number 'x'"),
            (vec!["/a", "/b"], "Invalid number of arguments"),
            (
                vec!["--tls-creds", "t0", "-k", "/s", "/f"],
                "only supported with IPv4/IPv6",
            ),
            (vec!["--cache=directsync", "/f"], "--cache=directsync"),
        ] {
            match serve_flags(&argv) {
                Err(m) => assert!(m.contains(want), "{argv:?}: {m}"),
                Ok(f) => panic!("{argv:?} accepted as {f:?}"),
            }
        }
    }

    #[test]
    fn tls_objects() {
        let f = serve_flags(&[
            "--object",
            "tls-creds-x509,id=tls0,endpoint=server,dir=/pki,verify-peer=false",
            "--tls-creds",
            "tls0",
            "-p",
            "10810",
            "/f",
        ])
        .unwrap();
        has(&f, &["--tls-certificates=/pki", "--port=10810"]);
        assert!(!f.iter().any(|x| x == "--tls-verify-peer"));
        let f = serve_flags(&[
            "--object=tls-creds-x509,id=t,endpoint=server,dir=/pki",
            "--tls-creds=t",
            "/f",
        ])
        .unwrap();
        has(&f, &["--tls-verify-peer"]);
        let f = serve_flags(&[
            "--object",
            "tls-creds-psk,id=p,endpoint=server,dir=/k",
            "--tls-creds=p",
            "/f",
        ])
        .unwrap();
        has(&f, &["--tls-psk=/k/keys.psk"]);
    }

    #[test]
    fn version_names_the_release_first() {
        let v = version("qemu-nbd");
        let first = v.lines().next().unwrap();
        let mut words = first.split_whitespace();
        assert_eq!(words.next(), Some("qemu-nbd"));
        assert_eq!(words.next(), Some(QEMU_NBD_RELEASE));
        assert!(first.contains("(rawdisk "), "{first}");
        assert!(!help("qemu-nbd").contains("selinux"));
    }
}
