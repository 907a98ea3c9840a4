use std::process::ExitCode;

/// STUB: filled in by the serve issue.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("'serve' is not implemented yet")
}
