//! The report as text: `rawdisk probe`'s human form and its JSON.

use super::{Choice, ProbeReport, State};
use crate::info::yes_no;
use crate::output::{human_size, table, Fields};

impl ProbeReport {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default() + "\n"
    }

    pub fn to_human(&self) -> String {
        let mut f = Fields::new();
        f.add("target", self.target.clone());
        f.add(
            "kind",
            if self.kind == "block" {
                "block device"
            } else {
                "regular file"
            },
        );
        if let Some(m) = &self.filesystem {
            f.add(
                "file system",
                format!("{} on {} ({})", m.fs_type, m.mount_point, m.source),
            );
        }
        f.add(
            "size",
            format!("{} bytes ({})", self.size, human_size(self.size)),
        );
        f.add("logical sector", self.logical_sector_size.to_string());
        f.add("physical sector", self.physical_sector_size.to_string());
        f.add("minimum I/O", self.minimum_io_size.to_string());
        f.add(
            "optimal I/O",
            if self.optimal_io_size == 0 {
                "0 (none reported)".into()
            } else {
                self.optimal_io_size.to_string()
            },
        );
        f.add("rotational", yes_no(self.rotational));
        f.add("read-only", yes_no(self.read_only));
        f.add(
            "direct I/O",
            match (self.direct_io, self.direct_io_alignment) {
                (State::Works, Some(a)) => format!("works (alignment {a})"),
                (s, _) => s.name().to_string(),
            },
        );
        if let Some(q) = &self.queue_limits {
            f.add("write-zeroes max", opt_bytes(q.write_zeroes_max_bytes));
            f.add("discard max", opt_bytes(q.discard_max_bytes));
            f.add("discard granularity", opt_bytes(q.discard_granularity));
        }
        if let Some(q) = &self.queue_limits_after {
            f.add(
                "after trying",
                format!(
                    "write-zeroes max {}, discard max {}",
                    opt_bytes(q.write_zeroes_max_bytes),
                    opt_bytes(q.discard_max_bytes)
                ),
            );
        }
        f.add(
            "tested on",
            match self.tested_on {
                "scratch-file" => match &self.scratch_file {
                    Some(s) => format!("scratch file {s} (removed)"),
                    None => "scratch file (could not be created)".into(),
                },
                "device" => "the device itself (first bytes saved and restored)".into(),
                _ => "sysfs and ioctls only, nothing written (--destructive tries each method)"
                    .into(),
            },
        );
        if let Some(e) = &self.scratch_error {
            f.add("scratch error", e.clone());
        }
        let mut s = f.render();
        s.push('\n');
        let rows: Vec<Vec<String>> = self
            .methods
            .iter()
            .map(|m| {
                vec![
                    m.method.to_string(),
                    m.state.name().to_string(),
                    m.detail.clone(),
                ]
            })
            .collect();
        s.push_str(&table(&["method", "state", "detail"], &rows));
        s.push('\n');
        let choice = |c: &Choice| {
            let mut t = c.method.clone();
            if !c.certain && c.method != "unknown" {
                t.push_str(" (if it works");
                if let Some(o) = &c.otherwise {
                    t.push_str(&format!("; else {o}"));
                }
                t.push(')');
            }
            t
        };
        let mut z = Fields::new();
        // The JSON's keys (zero: with-trim, without-trim, fast-zero, trim)
        // in words.
        z.add("zero with trim", choice(&self.zero.with_trim));
        z.add("zero without trim", choice(&self.zero.without_trim));
        let fast = yes_no_unknown(self.zero.fast_zero);
        z.add(
            "fast zero",
            match &self.zero.fast_zero_method {
                Some(m) if self.zero.fast_zero != Some(false) => format!("{fast} ({m})"),
                _ => fast.to_string(),
            },
        );
        z.add("trim", yes_no_unknown(self.zero.trim));
        s.push_str(&z.render());
        s
    }
}

fn yes_no_unknown(v: Option<bool>) -> &'static str {
    v.map_or("unknown", yes_no)
}

fn opt_bytes(v: Option<u64>) -> String {
    match v {
        Some(0) => "0 (none)".into(),
        Some(n) => format!("{n} ({})", human_size(n)),
        None => "unknown".into(),
    }
}
