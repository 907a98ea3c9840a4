//! The cache=none AIO path of the in-process server (`common::harness`)
//! under the fault the storage crate's injector cannot reach: the reaper's
//! eventfd poll failing while requests are in flight. Its own test binary,
//! since the fault is process-wide.

use std::collections::HashMap;

use rawdisk_nbd::proto::*;
use rawdisk_nbd::server::fault;
use rawdisk_storage::cbt::StateFile;

mod common;
use common::harness::*;

/// Each request in flight when the reaper loses its eventfd is still
/// answered (waited for on a blocking thread) and later ones go to the
/// pool; the writes are all in the checkpoint, marked at submit and again
/// when reaped. Before, the client waited for replies that never came.
#[test]
fn a_reaper_that_cannot_poll_still_answers_what_is_in_flight() {
    const GRAIN: u64 = 64 * KIB;
    fault::fail_aio_polls(true);
    let mut h = Harness::start(Setup {
        cache_none: true,
        track: Some(vec!["a"]),
        ..Default::default()
    });
    let (mut c, _) = h.open(ReplyMode::Simple);
    let mut replies = HashMap::new();
    let (mut reads, mut writes) = (Vec::new(), Vec::new());
    // Writes to even grains, reads of the odd ones: each read sees the file
    // as it was, and each written grain is a range of its own.
    for round in 0..4u64 {
        let mut out = Vec::new();
        for i in 0..16u64 {
            let off = (round * 16 + i) * 2 * GRAIN;
            let d = random(4096, 100 + round * 16 + i);
            let cookie = c.queue_req(&mut out, Command::Write, off, 4096, &d);
            writes.push((cookie, off, d));
            let cookie = c.queue_req(&mut out, Command::Read, off + GRAIN, 4096, &[]);
            reads.push((cookie, off + GRAIN));
        }
        // One send: the server gathers them into batches for the kernel.
        c.send(&out);
        for _ in 0..32 {
            // Times out (and fails) after 20 s if a reply never comes.
            let r = c.recv();
            assert_eq!(r.error, 0, "{}", r.message);
            replies.insert(r.cookie, r);
        }
    }
    assert!(fault::aio_polls_failed() > 0, "the reaper never polled");
    for (cookie, off) in reads {
        let want = &h.model[off as usize..off as usize + 4096];
        assert!(replies[&cookie].data == want, "read at {off}");
    }
    let mut want = Vec::new();
    for (cookie, off, d) in writes {
        assert!(replies[&cookie].data.is_empty());
        h.model[off as usize..off as usize + 4096].copy_from_slice(&d);
        want.push((off, GRAIN));
    }
    assert_eq!(c.cmd(Command::Flush, 0, 0, 0, &[]).error, 0);
    c.disc();
    h.stop().unwrap();
    h.check_file();
    let st = StateFile::open(&h.path, None, false).unwrap();
    assert_eq!(st.changed_ranges("a").unwrap(), want);
}
