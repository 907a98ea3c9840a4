use std::process::ExitCode;

/// STUB: filled in by the create issue.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("'create' is not implemented yet")
}
