//! Commands: [`run`] (panics on failure) and `try_run` (for cleanup, which
//! must go on after a failure).

use std::ffi::OsStr;
use std::process::Command;

/// Runs a command; panics with its stderr when it fails to start or exits non-zero.
pub fn run<I, S>(prog: &str, args: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<std::ffi::OsString> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
    match try_run(prog, &args) {
        Ok(out) => out,
        Err(e) => panic!("{e}"),
    }
}

/// Makes an ext4 file system on `dev`, a fresh sparse image that already
/// reads as zeros: no discard, and lazy inode-table and journal init (mount
/// it with `noinit_itable` so ext4lazyinit does not write in the background).
pub(crate) fn mkfs_ext4(dev: &std::path::Path) {
    run(
        "mkfs.ext4",
        [
            OsStr::new("-q"),
            OsStr::new("-F"),
            OsStr::new("-E"),
            OsStr::new("nodiscard,lazy_itable_init=1,lazy_journal_init=1"),
            dev.as_os_str(),
        ],
    );
}

pub(crate) fn try_run(prog: &str, args: &[std::ffi::OsString]) -> Result<String, String> {
    let shown = format!(
        "{prog} {}",
        args.iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let out = Command::new(prog)
        .args(args)
        // mkfs.*, losetup and mount live in /sbin; a test environment may not
        // have it on PATH.
        .env(
            "PATH",
            format!(
                "/usr/sbin:/usr/bin:/sbin:/bin:{}",
                std::env::var("PATH").unwrap_or_default()
            ),
        )
        .output()
        .map_err(|e| format!("cannot run `{shown}`: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "`{shown}` failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
