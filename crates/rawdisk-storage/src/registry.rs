//! Process-wide registry of [`Capabilities`], one per target, so every handle
//! opened on the same file or device (a server opens one per connection, copy
//! may open the same target twice) pays for an unsupported call only once.
//!
//! Keyed by (st_dev, st_ino) for regular files; for block devices by st_rdev,
//! because two device nodes (/dev/loop0 and a udev symlink target or a node in
//! a container) name the same device with different inodes. Entries hold a
//! `Weak`, so capabilities die with the last handle and a file that is
//! deleted and recreated with a recycled inode number starts fresh once no
//! handle of the old one is open.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::caps::{Capabilities, CopyCaps};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Key {
    File { dev: u64, ino: u64 },
    Block { rdev: u64 },
}

/// A pair of file systems for the copy offloads: the st_dev of the source's
/// and of the destination's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct PairKey {
    pub src_dev: u64,
    pub dst_dev: u64,
}

type Registry<K, V> = Mutex<HashMap<K, Weak<V>>>;

fn registry() -> &'static Registry<Key, Capabilities> {
    static R: OnceLock<Registry<Key, Capabilities>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

fn pair_registry() -> &'static Registry<PairKey, CopyCaps> {
    static R: OnceLock<Registry<PairKey, CopyCaps>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The value of `key`, created when no handle holds it.
fn shared<K: Eq + std::hash::Hash, V: Default>(reg: &Registry<K, V>, key: K) -> Arc<V> {
    let mut map = reg.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = map.get(&key).and_then(Weak::upgrade) {
        return c;
    }
    // Drop dead entries now and then so the map does not grow with every
    // temporary file a long-running process ever opened.
    map.retain(|_, w| w.strong_count() > 0);
    let c = Arc::new(V::default());
    map.insert(key, Arc::downgrade(&c));
    c
}

/// The shared capabilities of the target `key`, created when no handle holds them.
pub(crate) fn capabilities_for(key: Key) -> Arc<Capabilities> {
    shared(registry(), key)
}

/// The shared copy-offload capabilities of a pair of file systems.
pub(crate) fn copy_caps_for(key: PairKey) -> Arc<CopyCaps> {
    shared(pair_registry(), key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_key_shares_and_dies_with_last_handle() {
        let k = Key::File {
            dev: u64::MAX,
            ino: 42,
        };
        let a = capabilities_for(k);
        let b = capabilities_for(k);
        assert!(Arc::ptr_eq(&a, &b));
        let other = capabilities_for(Key::Block { rdev: u64::MAX });
        assert!(!Arc::ptr_eq(&a, &other));
        a.set(crate::caps::Method::PunchHole, crate::caps::Tri::Fails);
        assert_eq!(
            b.get(crate::caps::Method::PunchHole),
            crate::caps::Tri::Fails
        );
        let pa = Arc::as_ptr(&a) as usize;
        drop(a);
        drop(b);
        let c = capabilities_for(k);
        // A fresh allocation may reuse the address; what matters is the state.
        assert_eq!(
            c.generation(),
            0,
            "state from a dead handle leaked ({pa:#x})"
        );
    }
}
