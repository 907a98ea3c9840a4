//! Shared pieces of the commands' output: the output format, sizes printed
//! the way qemu-img prints them, and aligned "key: value" blocks.

/// `--output human|json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputFormat {
    #[default]
    Human,
    Json,
}

/// A size the way `qemu-img info` prints it: binary units, switching to the
/// next unit from 1000 of the current one, three significant digits, no
/// trailing zeros ("0 B", "512 B", "1.31 MiB", "10 MiB", "6 GiB").
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut unit = 0;
    let mut v = bytes as f64;
    while v >= 1000.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{} {}", three_digits(v), UNITS[unit])
}

/// `v` (0 <= v < 1000) with three significant digits and no trailing zeros.
fn three_digits(v: f64) -> String {
    let decimals = if v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else if v >= 1.0 {
        2
    } else {
        3
    };
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// Bytes per second for the summary lines ("1.42 GiB/s").
pub fn human_rate(bytes: u64, secs: f64) -> String {
    if secs <= 0.0 {
        return "-".into();
    }
    format!("{}/s", human_size((bytes as f64 / secs) as u64))
}

/// A duration in JSON summaries (`elapsed-seconds`): seconds, to the
/// millisecond.
pub fn secs(d: std::time::Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}

/// [`secs`] for serde's `serialize_with`.
pub fn serialize_secs<S: serde::Serializer>(
    d: &std::time::Duration,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_f64(secs(*d))
}

/// Prints `key: value` lines with the values aligned in one column.
#[derive(Default)]
pub struct Fields {
    rows: Vec<(String, String)>,
}

impl Fields {
    pub fn new() -> Fields {
        Fields::default()
    }

    pub fn add(&mut self, key: impl Into<String>, value: impl Into<String>) -> &mut Self {
        self.rows.push((key.into(), value.into()));
        self
    }

    pub fn render(&self) -> String {
        let w = self.rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
        let mut out = String::new();
        for (k, v) in &self.rows {
            let key = format!("{k}:");
            out.push_str(&format!("{key:<w$} {v}\n", w = w));
        }
        out
    }
}

/// Rows of cells printed as a table with left-aligned columns.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let n = header.len();
    let mut w: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate().take(n) {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(c);
                s.push_str(&" ".repeat(w[i] - c.chars().count() + 2));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(header.iter().map(|h| h.to_string()).collect());
    for r in rows {
        out.push_str(&line(r.clone()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_like_qemu_img() {
        // Values checked against `qemu-img info` 10.0 on files of these sizes.
        assert_eq!(human_size(0), "0 B");
        assert_eq!(human_size(512), "512 B");
        assert_eq!(human_size(1376256), "1.31 MiB");
        assert_eq!(human_size(10 << 20), "10 MiB");
        assert_eq!(human_size(6 << 30), "6 GiB");
        assert_eq!(human_size(1000), "0.977 KiB");
        assert_eq!(human_size(999), "999 B");
        assert_eq!(human_size(1536), "1.5 KiB");
    }

    #[test]
    fn fields_align() {
        let mut f = Fields::new();
        f.add("a", "1").add("long key", "2");
        assert_eq!(f.render(), "a:        1\nlong key: 2\n");
    }
}
