use std::process::ExitCode;

/// STUB: filled in by the map issue.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("'map' is not implemented yet")
}
