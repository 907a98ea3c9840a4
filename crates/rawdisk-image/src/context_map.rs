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

/// `--map --totals`: the bytes of each type, the types in ascending order,
/// with their share of the export (the sum of the runs).
pub fn totals(runs: &[Run]) -> Vec<(u64, f64, u64)> {
    let size: u64 = runs.iter().map(|r| r.1).sum();
    let mut by_type: std::collections::BTreeMap<u64, u64> = Default::default();
    for &(_, len, flags) in runs {
        *by_type.entry(flags).or_default() += len;
    }
    by_type
        .into_iter()
        .map(|(flags, n)| (n, 100.0 * n as f64 / size.max(1) as f64, flags))
        .collect()
}

/// nbdinfo's `--map --totals` text: `%10u %5.1f%% %3u description`.
pub fn totals_to_text(context: &str, runs: &[Run]) -> String {
    let mut s = String::new();
    for (n, pct, flags) in totals(runs) {
        s.push_str(&format!("{n:>10} {pct:>5.1}% {flags:>3}"));
        if let Some(d) = describe(context, flags) {
            s.push(' ');
            s.push_str(d);
        }
        s.push('\n');
    }
    s
}

/// nbdinfo's `--map --totals --json`: the percentage as C's `%g`.
pub fn totals_to_json(context: &str, runs: &[Run]) -> String {
    let items: Vec<String> = totals(runs)
        .into_iter()
        .map(|(n, pct, flags)| {
            let d = describe(context, flags)
                .map(|d| format!(", \"description\": \"{d}\""))
                .unwrap_or_default();
            format!(
                "{{ \"size\": {n}, \"percent\": {}, \"type\": {flags}{d} }}",
                c_g(pct)
            )
        })
        .collect();
    if items.is_empty() {
        return "[\n]\n".into();
    }
    format!("[\n{}\n]\n", items.join(",\n"))
}

/// C's `%g` for a percentage (0 to 100): six significant digits, trailing
/// zeros dropped.
fn c_g(v: f64) -> String {
    let digits = if v >= 1.0 {
        (v.log10().floor() as i32 + 1).clamp(1, 6)
    } else {
        1
    };
    let decimals = if v == 0.0 {
        0
    } else {
        (6 - digits).max(0) as usize
    };
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nbdinfo_totals() {
        let runs = [
            (0, 1048576, 0),
            (1048576, 1048576, 3),
            (2097152, 1048576, 3),
        ];
        assert_eq!(
            totals_to_text(BASE_ALLOCATION, &runs),
            "   1048576  33.3%   0 data\n   2097152  66.7%   3 hole,zero\n"
        );
        assert_eq!(
            totals_to_json(BASE_ALLOCATION, &runs),
            "[\n{ \"size\": 1048576, \"percent\": 33.3333, \"type\": 0, \"description\": \"data\" },\n\
             { \"size\": 2097152, \"percent\": 66.6667, \"type\": 3, \"description\": \"hole,zero\" }\n]\n"
        );
        assert_eq!(c_g(50.0), "50");
        assert_eq!(c_g(100.0), "100");
        assert_eq!(c_g(0.5), "0.5");
    }

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
