//! A blocking job that panics (a bug; made here by a FaultSys rule that
//! panics in a storage call) must not cost a reply (`server/transmission.rs`,
//! `caught`): each request it held is answered NBD_EIO, never success, the
//! rest of its batch and of the connection's zero line still run, and the
//! connection goes on. Before, the client waited forever for the replies.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rawdisk_nbd::proto::*;
use rawdisk_storage::sys::CallKind;
use rawdisk_storage::{FaultRule, FaultSys};

mod common;
use common::harness::*;

/// A reply that never comes fails the test after this long.
const PATIENCE: Duration = Duration::from_secs(5);

fn start(cache_none: bool) -> (Harness, Arc<FaultSys>, Conn) {
    let h = Harness::start(Setup {
        fault: true,
        cache_none,
        ..Default::default()
    });
    let fault = h.fault.clone().unwrap();
    let (c, _) = h.open(ReplyMode::Structured);
    c.s.set_read_timeout(Some(PATIENCE)).unwrap();
    (h, fault, c)
}

/// Sends the requests (a write with its payload from `payloads`) in one
/// write, so the server holds them all at once, and returns each one's
/// reply by cookie; every cookie answered once.
fn send_all(c: &mut Conn, reqs: &[(Command, u16, u64, u64)], payloads: &[Vec<u8>]) -> Vec<Reply> {
    let mut out = Vec::new();
    for (i, &(typ, flags, off, len)) in reqs.iter().enumerate() {
        let data = payloads.get(i).map_or(&[][..], |p| &p[..]);
        c.encode_req(&mut out, i as u64 + 1, typ, flags, off, len, data);
    }
    c.send(&out);
    let mut got: HashMap<u64, Reply> = HashMap::new();
    for _ in reqs {
        // Fails after PATIENCE if a reply never comes.
        let r = c.recv();
        let cookie = r.cookie;
        assert!(
            got.insert(cookie, r).is_none(),
            "cookie {cookie} answered twice"
        );
    }
    (1..=reqs.len() as u64)
        .map(|i| got.remove(&i).expect("a reply for every cookie"))
        .collect()
}

/// Bytes of a request answered EIO are each as before or zero; returns
/// what they are now, for the model.
fn old_or_zero(c: &mut Conn, model: &[u8], off: u64, len: u64) -> Vec<u8> {
    let got = c.read(off, len);
    let s = off as usize;
    let odd = (0..got.len()).find(|&i| got[i] != 0 && got[i] != model[s + i]);
    assert_eq!(odd, None, "a failed zero wrote something else");
    got
}

/// Twelve zeros queued on the zero line, one of them over a spot where the
/// storage call panics: twelve replies, those whose call panicked NBD_EIO,
/// the others done; later zeros still run, also over the spot again.
#[test]
fn a_panic_in_the_zero_line_answers_every_queued_zero() {
    let (mut h, fault, mut c) = start(false);
    let zs: Vec<_> = (0..12u64)
        .map(|i| {
            (
                Command::WriteZeroes,
                CMD_FLAG_NO_HOLE,
                MIB + i * 192 * KIB,
                192 * KIB,
            )
        })
        .collect();
    let spot = zs[5].2 + 64 * KIB;
    for kind in WRITING {
        fault.add(FaultRule::over(kind, spot, 4096, libc::EIO).panicking());
    }
    let replies = send_all(&mut c, &zs, &[]);
    assert_eq!(replies[5].error, NBD_EIO, "{}", replies[5].message);
    // Over the spot again, on a line that already lost a job: answered.
    let again = c.cmd(Command::WriteZeroes, 0, spot, 4096, &[]);
    assert_eq!(again.error, NBD_EIO, "{}", again.message);
    fault.clear_rules();
    for (r, &(_, _, off, len)) in replies.iter().zip(&zs) {
        let (s, e) = (off as usize, (off + len) as usize);
        match r.error {
            0 => h.model[s..e].fill(0),
            NBD_EIO => {
                let now = old_or_zero(&mut c, &h.model, off, len);
                h.model[s..e].copy_from_slice(&now);
            }
            err => panic!("zero at {off}: error {err}: {}", r.message),
        }
    }
    // The line goes on: the same zeros again all succeed.
    for (r, z) in send_all(&mut c, &zs, &[]).iter().zip(&zs) {
        assert_eq!(r.error, 0, "{z:?}: {}", r.message);
    }
    for &(_, _, off, len) in &zs {
        h.model[off as usize..(off + len) as usize].fill(0);
    }
    h.finish(c);
}

/// Under cache=none a FaultSys target has no AIO queue: twelve small reads
/// sent together run as one blocking job. The third read's pread panics:
/// it is answered NBD_EIO and the nine after it in the job still run.
#[test]
fn a_panic_mid_batch_answers_the_rest_of_the_batch() {
    let (mut h, fault, mut c) = start(true);
    let reads: Vec<_> = (0..12u64)
        .map(|i| (Command::Read, 0, i * 64 * KIB, 4096))
        .collect();
    fault.reset_counts();
    fault.add(FaultRule::once(CallKind::Pread, 3, libc::EIO).panicking());
    let replies = send_all(&mut c, &reads, &[]);
    assert!(fault.calls(CallKind::Pread) >= 3, "the fault was not met");
    let failed: Vec<_> = (0..12).filter(|&i| replies[i].error != 0).collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(replies[failed[0]].error, NBD_EIO);
    for (i, (r, &(_, _, off, len))) in replies.iter().zip(&reads).enumerate() {
        if i != failed[0] {
            let want = &h.model[off as usize..(off + len) as usize];
            assert!(r.data == want, "read {i} at {off}");
        }
    }
    // The connection goes on: a write and the whole export read back.
    let d = random(8192, 7);
    c.write(3 * MIB, &d);
    h.model[3 * MIB as usize..3 * MIB as usize + 8192].copy_from_slice(&d);
    h.finish(c);
}

/// What runs on the connection's reader: a read alone on the connection,
/// and small page-cache writes gathered with others. A panic there is
/// answered NBD_EIO too, and the connection goes on; before, the
/// connection's task unwound and the connection closed under the client.
#[test]
fn a_panic_on_the_connections_reader_is_answered() {
    let (mut h, fault, mut c) = start(false);
    fault.reset_counts();
    fault.add(FaultRule::once(CallKind::Pread, 1, libc::EIO).panicking());
    let r = c.cmd(Command::Read, 0, 0, 4096, &[]);
    assert_eq!(r.error, NBD_EIO, "{}", r.message);
    assert_eq!(c.read(0, 4096), h.model[..4096]);

    let base = 2 * MIB;
    let writes: Vec<_> = (0..12u64)
        .map(|i| (Command::Write, 0, base + i * 64 * KIB, 4096))
        .collect();
    let data: Vec<_> = (0..12).map(|i| random(4096, 50 + i)).collect();
    fault.clear_rules();
    fault.reset_counts();
    fault.add(FaultRule::once(CallKind::Pwrite, 3, libc::EIO).panicking());
    let replies = send_all(&mut c, &writes, &data);
    assert!(fault.calls(CallKind::Pwrite) >= 3, "the fault was not met");
    fault.clear_rules();
    let failed: Vec<_> = (0..12).filter(|&i| replies[i].error != 0).collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(replies[failed[0]].error, NBD_EIO);
    for (i, &(_, _, off, _)) in writes.iter().enumerate() {
        let at = off as usize..off as usize + 4096;
        if i == failed[0] {
            // The panic came before the write: as before, or all written.
            let now = c.read(off, 4096);
            assert!(now == h.model[at.clone()] || now == data[i], "write {i}");
            h.model[at].copy_from_slice(&now);
        } else {
            h.model[at].copy_from_slice(&data[i]);
        }
    }
    h.finish(c);
}
