//! Metadata contexts (spec: "Metadata querying"): `base:allocation`,
//! `qemu:allocation-depth`, and with changed-block tracking one
//! `rawdisk:changed:NAME` and one `qemu:dirty-bitmap:NAME` per checkpoint of
//! the export (docs/cbt.md). Matching is linear in queries plus
//! checkpoints, whatever a hostile client sends.

use std::collections::HashSet;

use rawdisk_storage::cbt::CheckpointInfo;
use tracing::warn;

use super::exports::Export;
use crate::proto::META_CONTEXT_BASE_ALLOCATION;

/// Context id of base:allocation; the other contexts follow it.
pub(super) const BASE_ALLOCATION_ID: u32 = 1;
/// The namespace of rawdisk's own contexts.
pub(super) const NAMESPACE: &str = "rawdisk:";
/// `rawdisk:changed:NAME`: the ranges changed since checkpoint NAME.
pub(super) const CHANGED_PREFIX: &str = "rawdisk:changed:";
/// `rawdisk:checkpoint:NAME:<source id hex>:<seq>`: list-only contexts
/// that tell a client each checkpoint's identity (what a backup records).
pub(super) const CHECKPOINT_PREFIX: &str = "rawdisk:checkpoint:";
/// Block status flag of a `rawdisk:changed:` context: the extent changed
/// since the checkpoint (clear: unchanged). qemu's NBD_STATE_DIRTY of a
/// `qemu:dirty-bitmap:` context is the same bit with the same meaning.
pub(super) const STATE_CHANGED: u32 = 1 << 0;
/// qemu's namespace (registered in the spec; qemu's docs/interop/nbd.rst).
pub(super) const QEMU_NAMESPACE: &str = "qemu:";
/// `qemu:dirty-bitmap:NAME`: what backup tools built on qemu-nbd's `-B
/// NAME` ask for; here the ranges changed since checkpoint NAME.
pub(super) const DIRTY_PREFIX: &str = "qemu:dirty-bitmap:";
/// `qemu:allocation-depth`: which layer of a backing chain holds a range.
pub(super) const ALLOCATION_DEPTH: &str = "qemu:allocation-depth";
/// Its value for every range of a raw image: 1, "this layer". A raw image
/// is its only layer, and a hole in it is part of that layer (it reads as
/// zeros from here, never from a backing file), so holes are 1 too: the
/// answer qemu-nbd -A gives for a raw file with holes. 0 would tell a
/// client (imageio, qemu's x-dirty-bitmap) to look in a backing file.
pub(super) const DEPTH_THIS_LAYER: u32 = 1;

/// One checkpoint as a connection selected it: its name and sequence
/// number, so that the name reused by a newer checkpoint is not read in
/// its place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Selected {
    pub(super) name: String,
    pub(super) seq: u64,
}

/// One metadata context a client may select.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Context {
    Allocation,
    /// `qemu:allocation-depth`.
    Depth,
    /// Changed since this checkpoint, as `rawdisk:changed:NAME`.
    Changed(Selected),
    /// The same as qemu's `qemu:dirty-bitmap:NAME` (flag 1: dirty).
    Dirty(Selected),
}

impl Context {
    pub(super) fn name(&self) -> String {
        match self {
            Context::Allocation => META_CONTEXT_BASE_ALLOCATION.to_string(),
            Context::Depth => ALLOCATION_DEPTH.to_string(),
            Context::Changed(c) => format!("{CHANGED_PREFIX}{}", c.name),
            Context::Dirty(c) => format!("{DIRTY_PREFIX}{}", c.name),
        }
    }

    /// The checkpoint a context reads, if any.
    pub(super) fn checkpoint(&self) -> Option<&Selected> {
        match self {
            Context::Changed(c) | Context::Dirty(c) => Some(c),
            Context::Allocation | Context::Depth => None,
        }
    }
}

/// The contexts of `e` that `queries` name: base:allocation,
/// qemu:allocation-depth, the `rawdisk:changed:` checkpoints oldest first,
/// then the `qemu:dirty-bitmap:` ones, each once. `bitmaps` limits the
/// latter to those names (`serve --bitmap`); None offers every checkpoint.
/// LIST (`set` false): no query lists everything, `base:`, `qemu:`,
/// `qemu:dirty-bitmap:`, `rawdisk:` and `rawdisk:changed:` list their part.
/// SET: exact names only (spec: an empty leaf name SHOULD NOT select
/// anything). Queries of other namespaces are ignored (spec: MUST).
pub(super) fn matching(
    e: &Export,
    queries: &[String],
    set: bool,
    bitmaps: Option<&[String]>,
) -> Vec<Context> {
    let cps = checkpoints(e)
        .into_iter()
        .map(|c| Selected {
            name: c.name,
            seq: c.seq,
        })
        .collect();
    select(cps, queries, set, bitmaps)
}

/// The list-only names LIST adds after [`matching`]'s: for a query
/// `rawdisk:checkpoint:` every checkpoint's, oldest first, for
/// `rawdisk:checkpoint:NAME` that one's. SET selects none of them (they
/// have no block status).
pub(super) fn listed_only(e: &Export, queries: &[String], set: bool) -> Vec<String> {
    if set || !queries.iter().any(|q| q.starts_with(CHECKPOINT_PREFIX)) {
        return Vec::new();
    }
    identities(checkpoints(e), queries)
}

fn identities(cps: Vec<CheckpointInfo>, queries: &[String]) -> Vec<String> {
    let mut all = false;
    let mut named: HashSet<&str> = HashSet::new();
    for q in queries {
        match q.strip_prefix(CHECKPOINT_PREFIX) {
            Some("") => all = true,
            Some(name) => {
                named.insert(name);
            }
            None => {}
        }
    }
    cps.into_iter()
        .filter(|c| all || named.contains(c.name.as_str()))
        .map(|c| format!("{CHECKPOINT_PREFIX}{}:{}", c.name, c.id))
        .collect()
}

/// Which checkpoints one namespace's queries name: all, or these.
#[derive(Default)]
struct Wanted<'q> {
    all: bool,
    named: HashSet<&'q str>,
}

impl Wanted<'_> {
    fn pick(&self, cps: &[Selected], offered: impl Fn(&str) -> bool) -> Vec<Selected> {
        cps.iter()
            .filter(|c| offered(&c.name) && (self.all || self.named.contains(c.name.as_str())))
            .cloned()
            .collect()
    }
}

fn select(
    cps: Vec<Selected>,
    queries: &[String],
    set: bool,
    bitmaps: Option<&[String]>,
) -> Vec<Context> {
    let everything = !set && queries.is_empty();
    let mut allocation = everything;
    let mut depth = everything;
    let mut changed = Wanted {
        all: everything,
        ..Default::default()
    };
    let mut dirty = Wanted {
        all: everything,
        ..Default::default()
    };
    for q in queries {
        let q = q.as_str();
        if q == META_CONTEXT_BASE_ALLOCATION || (!set && q == "base:") {
            allocation = true;
        } else if q == ALLOCATION_DEPTH {
            depth = true;
        } else if !set && q == QEMU_NAMESPACE {
            depth = true;
            dirty.all = true;
        } else if !set && (q == NAMESPACE || q == CHANGED_PREFIX) {
            changed.all = true;
        } else if !set && q == DIRTY_PREFIX {
            dirty.all = true;
        } else if let Some(name) = q.strip_prefix(CHANGED_PREFIX) {
            changed.named.insert(name);
        } else if let Some(name) = q.strip_prefix(DIRTY_PREFIX) {
            dirty.named.insert(name);
        }
    }
    let mut out = Vec::new();
    if allocation {
        out.push(Context::Allocation);
    }
    if depth {
        out.push(Context::Depth);
    }
    out.extend(
        changed
            .pick(&cps, |_| true)
            .into_iter()
            .map(Context::Changed),
    );
    let offered = |n: &str| bitmaps.is_none_or(|b| b.iter().any(|x| x == n));
    out.extend(dirty.pick(&cps, offered).into_iter().map(Context::Dirty));
    out
}

/// Ids for selected contexts: base:allocation always 1, the others 2, 3,
/// ... in the order of the reply.
pub(super) fn numbered(found: Vec<Context>) -> Vec<(u32, Context)> {
    let mut next = BASE_ALLOCATION_ID + 1;
    found
        .into_iter()
        .map(|c| {
            let id = if c == Context::Allocation {
                BASE_ALLOCATION_ID
            } else {
                next += 1;
                next - 1
            };
            (id, c)
        })
        .collect()
}

/// The export's checkpoints as the state file has them now (another
/// process may have created or deleted some); none without tracking.
fn checkpoints(e: &Export) -> Vec<CheckpointInfo> {
    let Some(t) = e.tracker() else {
        return Vec::new();
    };
    refresh(e);
    t.checkpoints()
}

/// Picks up checkpoints made or deleted by `rawdisk checkpoint` while the
/// export is served. A failure leaves the last known list in place.
pub(super) fn refresh(e: &Export) {
    if let Some(t) = e.tracker() {
        if let Err(err) = t.refresh() {
            warn!("export {:?}: {err}", e.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(found: &[Context]) -> Vec<String> {
        found.iter().map(Context::name).collect()
    }

    fn cps(names: &[&str]) -> Vec<Selected> {
        (1..)
            .zip(names)
            .map(|(seq, n)| Selected {
                name: n.to_string(),
                seq,
            })
            .collect()
    }

    fn run_with(queries: &[&str], set: bool, bitmaps: Option<&[String]>) -> Vec<String> {
        let q: Vec<String> = queries.iter().map(|s| s.to_string()).collect();
        names(&select(cps(&["a", "b"]), &q, set, bitmaps))
    }

    fn run(queries: &[&str], set: bool) -> Vec<String> {
        run_with(queries, set, None)
    }

    const ALL: [&str; 6] = [
        "base:allocation",
        "qemu:allocation-depth",
        "rawdisk:changed:a",
        "rawdisk:changed:b",
        "qemu:dirty-bitmap:a",
        "qemu:dirty-bitmap:b",
    ];

    #[test]
    fn list_queries() {
        assert_eq!(run(&[], false), ALL);
        assert_eq!(run(&["rawdisk:"], false), ALL[2..4]);
        assert_eq!(run(&["rawdisk:changed:"], false), ALL[2..4]);
        assert_eq!(run(&["qemu:"], false), [ALL[1], ALL[4], ALL[5]]);
        assert_eq!(run(&["qemu:dirty-bitmap:"], false), ALL[4..]);
        assert_eq!(run(&["qemu:allocation-depth"], false), [ALL[1]]);
        assert_eq!(
            run(
                &["qemu:dirty-bitmap:b", "rawdisk:changed:b", "base:"],
                false
            ),
            [ALL[0], ALL[3], ALL[5]]
        );
        let ignored = [
            "x-y:z",
            "nocolon",
            "rawdisk:other",
            "rawdisk:changed:c",
            "qemu:dirty-bitmap:c",
            "qemu:other",
            "qemu:allocation-depth:",
            "qemu:dirty-bitmap",
            "base:other",
        ];
        assert!(run(&ignored, false).is_empty());
    }

    #[test]
    fn bitmaps_limit_only_qemus_names() {
        let b = ["b".to_string()];
        let only_b = Some(&b[..]);
        assert_eq!(
            run_with(&[], false, only_b),
            [ALL[0], ALL[1], ALL[2], ALL[3], ALL[5]]
        );
        assert_eq!(run_with(&["qemu:dirty-bitmap:"], false, only_b), [ALL[5]]);
        assert_eq!(run_with(&["qemu:"], false, only_b), [ALL[1], ALL[5]]);
        assert!(run_with(&["qemu:dirty-bitmap:a"], true, only_b).is_empty());
        assert_eq!(
            run_with(&["qemu:dirty-bitmap:a", "rawdisk:changed:a"], true, only_b),
            [ALL[2]]
        );
        assert_eq!(run_with(&["qemu:dirty-bitmap:b"], true, only_b), [ALL[5]]);
    }

    #[test]
    fn set_takes_exact_names_once_with_ids() {
        assert!(run(&[], true).is_empty());
        let wild = [
            "rawdisk:",
            "rawdisk:changed:",
            "base:",
            "qemu:",
            "qemu:dirty-bitmap:",
        ];
        assert!(run(&wild, true).is_empty());
        let q = ["rawdisk:changed:b", "rawdisk:changed:b", "base:allocation"];
        assert_eq!(run(&q, true), ["base:allocation", "rawdisk:changed:b"]);
        let q: Vec<String> = [
            "qemu:dirty-bitmap:a",
            "rawdisk:changed:b",
            "qemu:allocation-depth",
            "rawdisk:changed:a",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let got = numbered(select(cps(&["a", "b"]), &q, true, None));
        let ids: Vec<(u32, String)> = got.iter().map(|(i, c)| (*i, c.name())).collect();
        assert_eq!(
            ids,
            [
                (2, ALL[1].to_string()),
                (3, ALL[2].to_string()),
                (4, ALL[3].to_string()),
                (5, ALL[4].to_string())
            ]
        );
        // The selection remembers which checkpoint the name meant.
        assert_eq!(got[3].1.checkpoint().map(|c| c.seq), Some(1));
        let ids: Vec<u32> = numbered(vec![Context::Allocation])
            .iter()
            .map(|p| p.0)
            .collect();
        assert_eq!(ids, [1]);
    }

    #[test]
    fn checkpoint_identities_are_listed_by_their_own_query() {
        let cp = |name: &str, seq: u64| CheckpointInfo {
            name: name.into(),
            created: 0,
            consistent: true,
            reason: None,
            id: format!("{}:{seq}", "ab".repeat(16)),
            seq,
        };
        let cps = || vec![cp("a", 1), cp("b", 2)];
        let q = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let id = |n: &str, s: u64| format!("rawdisk:checkpoint:{n}:{}:{s}", "ab".repeat(16));
        assert_eq!(
            identities(cps(), &q(&["rawdisk:checkpoint:"])),
            [id("a", 1), id("b", 2)]
        );
        assert_eq!(
            identities(cps(), &q(&["rawdisk:checkpoint:b", "rawdisk:checkpoint:c"])),
            [id("b", 2)]
        );
        assert!(identities(cps(), &q(&["rawdisk:", "rawdisk:changed:"])).is_empty());
        // Not selectable, and not in the wildcard lists of the others.
        assert!(run(&["rawdisk:checkpoint:", "rawdisk:checkpoint:a"], true).is_empty());
        assert!(run(&["rawdisk:checkpoint:"], false).is_empty());
    }

    #[test]
    fn many_queries_cost_one_pass() {
        let names: Vec<String> = (0..32).map(|i| format!("c{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let q: Vec<String> = (0..10_000)
            .flat_map(|i| {
                [
                    format!("rawdisk:changed:c{}", i % 40),
                    format!("qemu:dirty-bitmap:c{}", i % 40),
                ]
            })
            .collect();
        assert_eq!(select(cps(&refs), &q, true, None).len(), 64);
    }
}
