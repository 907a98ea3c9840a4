//! Standard output for the commands' results. A reader that went away
//! (`rawdisk info x | head -1`) is not an error: the rest of the output is
//! dropped and the command ends with the status it would have had, as
//! qemu-img does. `println!` would panic there instead.

use std::io::{ErrorKind, Write};

/// Writes `text` to standard output. Fails only for a real write error
/// (a full disk behind a redirection), never for a closed pipe.
pub fn print(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != ErrorKind::BrokenPipe => {
            Err(anyhow::anyhow!("write to standard output: {e}"))
        }
        _ => Ok(()),
    }
}

/// `text` and a newline.
pub fn println(text: impl std::fmt::Display) -> anyhow::Result<()> {
    print(&format!("{text}\n"))
}

/// `line` and a newline on stderr, errors ignored: a message that cannot be
/// written must not become a panic (eprintln!'s, on a closed pipe) that
/// changes the exit status or skips what comes after it.
pub fn say(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// A `println!` elsewhere that meets a closed standard output panics with
/// this message; the process then ends quietly, like [`print`], instead
/// of printing a panic.
pub fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        let epipe = std::io::Error::from_raw_os_error(libc::EPIPE).to_string();
        if msg.starts_with("failed printing to stdout") && msg.ends_with(&epipe) {
            std::process::exit(0);
        }
        default(info);
    }));
}
