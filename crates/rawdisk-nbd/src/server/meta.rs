//! Metadata contexts (spec: "Metadata querying"): `base:allocation`, and
//! with changed-block tracking one `rawdisk:changed:NAME` per checkpoint of
//! the export (docs/cbt.md). Matching is linear in queries plus
//! checkpoints, whatever a hostile client sends.

use std::collections::HashSet;

use rawdisk_storage::cbt::CheckpointInfo;
use tracing::warn;

use super::exports::Export;
use crate::proto::META_CONTEXT_BASE_ALLOCATION;

/// Context id of base:allocation; checkpoint contexts follow it.
pub(super) const BASE_ALLOCATION_ID: u32 = 1;
/// The namespace of rawdisk's own contexts.
pub(super) const NAMESPACE: &str = "rawdisk:";
/// `rawdisk:changed:NAME`: the ranges changed since checkpoint NAME.
pub(super) const CHANGED_PREFIX: &str = "rawdisk:changed:";
/// `rawdisk:checkpoint:NAME:<source id hex>:<seq>`: list-only contexts
/// that tell a client each checkpoint's identity (what a backup records).
pub(super) const CHECKPOINT_PREFIX: &str = "rawdisk:checkpoint:";
/// Block status flag of a `rawdisk:changed:` context: the extent changed
/// since the checkpoint (clear: unchanged).
pub(super) const STATE_CHANGED: u32 = 1 << 0;

/// One metadata context a client may select.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Context {
    Allocation,
    /// Changed since this checkpoint.
    Changed(String),
}

impl Context {
    pub(super) fn name(&self) -> String {
        match self {
            Context::Allocation => META_CONTEXT_BASE_ALLOCATION.to_string(),
            Context::Changed(c) => format!("{CHANGED_PREFIX}{c}"),
        }
    }
}

/// The contexts of `e` that `queries` name, base:allocation first, then the
/// checkpoints oldest first, each once. LIST (`set` false): no query lists
/// everything, `base:` and `rawdisk:` / `rawdisk:changed:` list their
/// namespace. SET: exact names only (spec: an empty leaf name SHOULD NOT
/// select anything). Queries of other namespaces are ignored (spec: MUST).
pub(super) fn matching(e: &Export, queries: &[String], set: bool) -> Vec<Context> {
    let names = checkpoints(e).into_iter().map(|c| c.name).collect();
    select(names, queries, set)
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

fn select(checkpoints: Vec<String>, queries: &[String], set: bool) -> Vec<Context> {
    let everything = !set && queries.is_empty();
    let mut allocation = everything;
    let mut all_changed = everything;
    let mut named: HashSet<&str> = HashSet::new();
    for q in queries {
        let q = q.as_str();
        if q == META_CONTEXT_BASE_ALLOCATION || (!set && q == "base:") {
            allocation = true;
        } else if !set && (q == NAMESPACE || q == CHANGED_PREFIX) {
            all_changed = true;
        } else if let Some(name) = q.strip_prefix(CHANGED_PREFIX) {
            named.insert(name);
        }
    }
    let mut out = Vec::new();
    if allocation {
        out.push(Context::Allocation);
    }
    out.extend(
        checkpoints
            .into_iter()
            .filter(|c| all_changed || named.contains(c.as_str()))
            .map(Context::Changed),
    );
    out
}

/// Ids for selected contexts: base:allocation always 1, the checkpoint
/// contexts 2, 3, ... in the order of the reply.
pub(super) fn numbered(found: Vec<Context>) -> Vec<(u32, Context)> {
    let mut next = BASE_ALLOCATION_ID + 1;
    found
        .into_iter()
        .map(|c| {
            let id = match c {
                Context::Allocation => BASE_ALLOCATION_ID,
                Context::Changed(_) => {
                    next += 1;
                    next - 1
                }
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

    fn run(queries: &[&str], set: bool) -> Vec<String> {
        let cps = vec!["a".to_string(), "b".to_string()];
        let q: Vec<String> = queries.iter().map(|s| s.to_string()).collect();
        names(&select(cps, &q, set))
    }

    #[test]
    fn list_queries() {
        let all = ["base:allocation", "rawdisk:changed:a", "rawdisk:changed:b"];
        assert_eq!(run(&[], false), all);
        assert_eq!(run(&["rawdisk:"], false), all[1..]);
        assert_eq!(run(&["rawdisk:changed:"], false), all[1..]);
        assert_eq!(
            run(&["rawdisk:changed:b", "base:"], false),
            [all[0], all[2]]
        );
        let ignored = [
            "x-y:z",
            "nocolon",
            "rawdisk:other",
            "rawdisk:changed:c",
            "base:other",
        ];
        assert!(run(&ignored, false).is_empty());
    }

    #[test]
    fn set_takes_exact_names_once_with_ids() {
        assert!(run(&[], true).is_empty());
        assert!(run(&["rawdisk:", "rawdisk:changed:", "base:"], true).is_empty());
        let q = ["rawdisk:changed:b", "rawdisk:changed:b", "base:allocation"];
        assert_eq!(run(&q, true), ["base:allocation", "rawdisk:changed:b"]);
        let cps = vec!["a".to_string(), "b".to_string()];
        let q = vec![
            "rawdisk:changed:b".to_string(),
            "rawdisk:changed:a".to_string(),
        ];
        let ids: Vec<u32> = numbered(select(cps, &q, true))
            .iter()
            .map(|p| p.0)
            .collect();
        assert_eq!(ids, [2, 3]);
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
        let cps: Vec<String> = (0..32).map(|i| format!("c{i}")).collect();
        let q: Vec<String> = (0..20_000)
            .map(|i| format!("rawdisk:changed:c{}", i % 40))
            .collect();
        assert_eq!(select(cps, &q, true).len(), 32);
    }
}
