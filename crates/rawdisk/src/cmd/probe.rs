use std::process::ExitCode;

/// STUB: filled in by the probe issue.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("'probe' is not implemented yet")
}
