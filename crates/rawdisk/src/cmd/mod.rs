//! One module per subcommand. Each defines its clap `Args` and a `run`.
pub mod copy;
pub mod create;
pub mod info;
pub mod map;
pub mod probe;
pub mod serve;
