use std::process::ExitCode;

/// STUB: filled in by the copy issue.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("'copy' is not implemented yet")
}
