//! `rawdisk generate-docs DIR` (hidden): man pages and shell completions
//! made from the clap definitions, so they never drift from `--help`.
//! scripts/install.sh runs it and copies the files under a PREFIX.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap_complete::Shell;

/// Write DIR/man1/rawdisk.1 and rawdisk-COMMAND.1 for each command, and
/// DIR/completions/rawdisk.bash, _rawdisk (zsh), rawdisk.fish.
#[derive(clap::Args)]
#[command(after_help = "Example:\n  rawdisk generate-docs target/docs")]
pub struct Args {
    /// Directory to write into (created if missing).
    dir: PathBuf,
}

pub fn run(cmd: clap::Command, args: Args) -> anyhow::Result<ExitCode> {
    let man = args.dir.join("man1");
    let comp = args.dir.join("completions");
    for d in [&man, &comp] {
        fs::create_dir_all(d).with_context(|| format!("cannot create '{}'", d.display()))?;
    }
    let cmd = shown(&cmd);
    let mut built = cmd.clone().disable_help_subcommand(true);
    built.build();
    let pages = std::iter::once(built.clone()).chain(built.get_subcommands().cloned());
    for page in pages {
        let m = clap_mangen::Man::new(page)
            .source(format!("rawdisk {}", env!("CARGO_PKG_VERSION")))
            .manual("rawdisk");
        let mut roff = Vec::new();
        m.render(&mut roff)?;
        // after_help holds each command's examples; clap_mangen titles it
        // EXTRA.
        let text = String::from_utf8_lossy(&roff).replace(".SH EXTRA", ".SH EXAMPLES");
        let path = man.join(m.get_filename());
        fs::write(&path, text).with_context(|| format!("cannot write '{}'", path.display()))?;
    }
    for (shell, file) in [
        (Shell::Bash, "rawdisk.bash"),
        (Shell::Zsh, "_rawdisk"),
        (Shell::Fish, "rawdisk.fish"),
    ] {
        completion(&cmd, shell, &comp.join(file))?;
    }
    crate::out::println(args.dir.display())?;
    Ok(ExitCode::SUCCESS)
}

/// The command without its hidden subcommands (this one), which neither
/// the man pages nor the completions should offer.
fn shown(cmd: &clap::Command) -> clap::Command {
    let mut c = clap::Command::new("rawdisk")
        .version(env!("CARGO_PKG_VERSION"))
        .args(cmd.get_arguments().cloned())
        .subcommands(cmd.get_subcommands().filter(|s| !s.is_hide_set()).cloned());
    if let Some(about) = cmd.get_about() {
        c = c.about(about.clone());
    }
    c
}

fn completion(cmd: &clap::Command, shell: Shell, path: &Path) -> anyhow::Result<()> {
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut cmd.clone(), "rawdisk", &mut out);
    fs::write(path, out).with_context(|| format!("cannot write '{}'", path.display()))
}
