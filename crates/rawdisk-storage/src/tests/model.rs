//! Random operations against an in-memory model.

use super::*;

#[test]
fn random_ops_match_a_model() {
    for cache in [CacheMode::Writeback, CacheMode::None] {
        let size: u64 = 1 << 20;
        let tmp = tmp_file(size);
        let opts = OpenOptions {
            cache,
            write_zeros_chunk: Some(3000),
            max_zero_call: Some(50_000),
            ..Default::default()
        };
        let (t, f) = open_fault(&tmp, opts);
        let mut model = vec![0u8; size as usize];
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        for step in 0..300 {
            if step == 100 {
                f.fail_from(PUNCH, 1, libc::EOPNOTSUPP);
            }
            if step == 200 {
                f.fail_from(ZRANGE, 1, libc::EOPNOTSUPP);
            }
            let off = rng.gen_range(0..size);
            let len = rng.gen_range(0..=(size - off).min(200_000));
            match rng.gen_range(0..4) {
                0 | 1 => {
                    let d = pattern(rng.gen::<u32>() as u64, len as usize);
                    t.write_at(&d, off, rng.gen()).unwrap();
                    model[off as usize..(off + len) as usize].copy_from_slice(&d);
                }
                2 => {
                    let fl = ZeroFlags {
                        may_trim: rng.gen(),
                        fast_only: false,
                    };
                    t.zero(off, len, fl).unwrap();
                    model[off as usize..(off + len) as usize].fill(0);
                }
                _ => {
                    // Trim leaves old data or zeros; the model cannot know
                    // which, so read it back and adopt it if it is either.
                    t.trim(off, len).unwrap();
                    let mut b = vec![0u8; len as usize];
                    t.read_at(&mut b, off).unwrap();
                    let old = &model[off as usize..(off + len) as usize];
                    for (i, x) in b.iter().enumerate() {
                        assert!(*x == 0 || *x == old[i], "trim invented data");
                    }
                    model[off as usize..(off + len) as usize].copy_from_slice(&b);
                }
            }
        }
        let mut all = vec![0u8; size as usize];
        t.read_at(&mut all, 0).unwrap();
        assert!(all == model, "content differs from the model ({cache:?})");
        assert_eq!(t.size(), size);
    }
}
