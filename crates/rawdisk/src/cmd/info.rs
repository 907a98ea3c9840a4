use std::process::ExitCode;

/// STUB: filled in by the info issue.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("'info' is not implemented yet")
}
