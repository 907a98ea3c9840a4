//! `rawdisk info --map[=CONTEXT] URI`: the runs of one NBD metadata context
//! as `nbdinfo --map` prints them (start, length, the context's raw flags,
//! a description where the flags have names), in its text or JSON form.

use crate::endpoint::{Endpoint, EndpointOptions};
use crate::error::{Error, Result};

/// The context `--map` shows when none is named (nbdinfo's default).
pub const BASE_ALLOCATION: &str = "base:allocation";

/// One run: offset, length, flags.
pub type Run = (u64, u64, u64);

/// The runs of `context` over the whole export `uri`, adjacent runs with
/// the same flags merged.
pub fn context_runs(uri: &str, context: &str) -> Result<Vec<Run>> {
    let base = context == BASE_ALLOCATION;
    let opts = EndpointOptions {
        raw: true,
        extra_contexts: if base {
            vec![]
        } else {
            vec![context.to_string()]
        },
        ..Default::default()
    };
    let ep = Endpoint::open_with(uri, &opts)
        .map_err(|e| Error::with(format!("cannot connect to '{uri}'"), e))?;
    let runs = runs_of(&ep, context, base);
    let _ = ep.close();
    runs
}

fn runs_of(ep: &Endpoint, context: &str, base: bool) -> Result<Vec<Run>> {
    let no_context = || {
        Error::msg(format!(
            "--map: the server does not offer metadata context {context}"
        ))
    };
    if base
        && ep
            .nbd_info()
            .and_then(|i| i.meta_context.as_ref())
            .is_none()
    {
        return Err(no_context());
    }
    let size = ep.size();
    let failed = |e| Error::with(format!("cannot map {context}"), e);
    let mut out: Vec<Run> = Vec::new();
    let mut pos = 0;
    while pos < size {
        let got: Vec<Run> = if base {
            ep.extents(pos, size - pos)
                .map_err(failed)?
                .into_iter()
                .map(|e| (e.offset, e.len, (!e.data as u64) | ((e.zero as u64) << 1)))
                .collect()
        } else {
            ep.context_status(context, pos, size - pos)
                .map_err(failed)?
        };
        if got.is_empty() {
            return Err(Error::msg(format!(
                "--map: the server described nothing at offset {pos} of {context}"
            )));
        }
        for (off, len, flags) in got {
            match out.last_mut() {
                Some(last) if last.2 == flags && last.0 + last.1 == off => last.1 += len,
                _ => out.push((off, len, flags)),
            }
            pos = off + len;
        }
    }
    Ok(out)
}

/// What the flags of a run mean, for the contexts whose flags have names.
fn describe(context: &str, flags: u64) -> Option<&'static str> {
    if context == BASE_ALLOCATION {
        return Some(match flags {
            0 => "data",
            1 => "hole",
            2 => "zero",
            3 => "hole,zero",
            _ => return None,
        });
    }
    if context.starts_with("rawdisk:changed:") {
        return Some(match flags {
            0 => "unchanged",
            1 => "changed",
            _ => return None,
        });
    }
    None
}

/// nbdinfo's text: `%10u  %10u  %3u  description`, one run a line.
pub fn to_text(context: &str, runs: &[Run]) -> String {
    let mut s = String::new();
    for &(off, len, flags) in runs {
        s.push_str(&format!("{off:>10}  {len:>10}  {flags:>3}"));
        if let Some(d) = describe(context, flags) {
            s.push_str("  ");
            s.push_str(d);
        }
        s.push('\n');
    }
    s
}

/// nbdinfo's JSON: an array, one object a line.
pub fn to_json(context: &str, runs: &[Run]) -> String {
    let items: Vec<String> = runs
        .iter()
        .map(|&(off, len, flags)| {
            let d = describe(context, flags)
                .map(|d| format!(", \"description\": \"{d}\""))
                .unwrap_or_default();
            format!("{{ \"offset\": {off}, \"length\": {len}, \"type\": {flags}{d}}}")
        })
        .collect();
    if items.is_empty() {
        return "[\n]\n".into();
    }
    format!("[\n{}\n]\n", items.join(",\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nbdinfo_forms() {
        let runs = [(0, 1048576, 0), (1048576, 1048576, 3)];
        assert_eq!(
            to_text(BASE_ALLOCATION, &runs),
            "         0     1048576    0  data\n   1048576     1048576    3  hole,zero\n"
        );
        assert_eq!(
            to_json("x:y", &runs[..1]),
            "[\n{ \"offset\": 0, \"length\": 1048576, \"type\": 0}\n]\n"
        );
        assert_eq!(
            to_text("rawdisk:changed:a", &[(0, 4096, 1)]),
            "         0        4096    1  changed\n"
        );
    }
}
