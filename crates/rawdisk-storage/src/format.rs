//! What an image looks like: the headers (and trailers) of the formats
//! `qemu-img` probes, so that no command takes a qcow2 or VMDK file for a
//! raw disk without being told (`-f raw`). The one place that knows the
//! magic numbers: the image commands, `resize` and the server all ask here.
//!
//! Only positive evidence counts: a header of zeros, or anything that does
//! not carry a format's signature where that format puts it, is raw.

use std::fmt;

/// Bytes of the start of an image [`detect`] looks at.
pub const HEAD_LEN: usize = 4096;
/// Bytes of the end of an image [`detect`] looks at (the VHD footer, the
/// DMG trailer).
pub const TAIL_LEN: usize = 512;

/// An image format other than raw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Qcow,
    Qcow2,
    Qed,
    Vmdk,
    Vhdx,
    Vpc,
    Vdi,
    Luks,
    Parallels,
    Bochs,
    Cloop,
    Dmg,
}

impl Format {
    /// qemu-img's name of the format.
    pub fn name(self) -> &'static str {
        match self {
            Format::Qcow => "qcow",
            Format::Qcow2 => "qcow2",
            Format::Qed => "qed",
            Format::Vmdk => "vmdk",
            Format::Vhdx => "vhdx",
            Format::Vpc => "vpc",
            Format::Vdi => "vdi",
            Format::Luks => "luks",
            Format::Parallels => "parallels",
            Format::Bochs => "bochs",
            Format::Cloop => "cloop",
            Format::Dmg => "dmg",
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

fn be32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

/// The first line of a cloop image: a shell script that mounts it.
const CLOOP_PREAMBLE: &[u8] =
    b"#!/bin/sh\n#V2.0 Format\nmodprobe cloop file=$0 && mount -r -t iso9660 /dev/cloop $1\n";

/// What `head` (the first bytes of the image, up to [`HEAD_LEN`]) and `tail`
/// (its last [`TAIL_LEN`] bytes, when the image has that many) show, or
/// None for raw.
pub fn detect(head: &[u8], tail: Option<&[u8]>) -> Option<Format> {
    let at0 = |m: &[u8]| head.starts_with(m);
    if at0(b"QFI\xfb") {
        // One magic for both: version 1 is the old qcow, 2 and 3 qcow2.
        return match be32(head, 4) {
            Some(1) => Some(Format::Qcow),
            Some(2..) => Some(Format::Qcow2),
            _ => None,
        };
    }
    if at0(b"QED\0") {
        return Some(Format::Qed);
    }
    // Sparse VMDK extents: "KDMV" (version 4 on) and "COWD" (ESX/version 3).
    if at0(b"KDMV") || at0(b"COWD") {
        return Some(Format::Vmdk);
    }
    if at0(b"vhdxfile") {
        return Some(Format::Vhdx);
    }
    // A dynamic VHD carries a copy of its footer at offset 0.
    if at0(b"conectix") {
        return Some(Format::Vpc);
    }
    // LUKS version 1 and 2 share the magic; the version follows it.
    if at0(b"LUKS\xba\xbe") && matches!(be16(head, 6), Some(1 | 2)) {
        return Some(Format::Luks);
    }
    // VDI: a text banner, then the signature at offset 64.
    if le32(head, 64) == Some(0xbeda_107f) {
        return Some(Format::Vdi);
    }
    if (at0(b"WithoutFreeSpace") || at0(b"WithouFreSpacExt")) && le32(head, 16) == Some(2) {
        return Some(Format::Parallels);
    }
    if at0(b"Bochs Virtual HD Image\0")
        && head.get(32..40) == Some(b"Redolog\0")
        && head.get(48..56) == Some(b"Growing\0")
    {
        return Some(Format::Bochs);
    }
    if at0(CLOOP_PREAMBLE) {
        return Some(Format::Cloop);
    }
    if vmdk_descriptor(head) {
        return Some(Format::Vmdk);
    }
    let tail = tail.filter(|t| t.len() >= TAIL_LEN)?;
    // A fixed VHD is raw data followed by a footer in the last sector.
    if tail.starts_with(b"conectix") {
        return Some(Format::Vpc);
    }
    // The DMG trailer ("koly" block): version 4, header size 512.
    if tail.starts_with(b"koly") && be32(tail, 4) == Some(4) && be32(tail, 8) == Some(512) {
        return Some(Format::Dmg);
    }
    None
}

/// A VMDK text descriptor: comment lines (the first is "# Disk
/// DescriptorFile") and blank space, then "version=1", 2 or 3 on a line of
/// its own, as qemu probes it.
fn vmdk_descriptor(head: &[u8]) -> bool {
    let mut rest = head;
    loop {
        match rest.first() {
            Some(b'#') => {
                let Some(nl) = rest.iter().position(|&c| c == b'\n') else {
                    return false;
                };
                rest = &rest[nl + 1..];
            }
            Some(b' ' | b'\t' | b'\r' | b'\n') => rest = &rest[1..],
            Some(_) => {
                let Some(v) = rest.strip_prefix(b"version=") else {
                    return false;
                };
                return matches!(
                    v,
                    [b'1'..=b'3', b'\n', ..] | [b'1'..=b'3', b'\r', b'\n', ..]
                );
            }
            None => return false,
        }
    }
}

/// Reads the head and the tail of an image of `size` bytes through `read`
/// (exactly `buf.len()` bytes at an offset) and tells what it looks like.
pub fn probe<E>(
    size: u64,
    mut read: impl FnMut(&mut [u8], u64) -> std::result::Result<(), E>,
) -> std::result::Result<Option<Format>, E> {
    let mut head = vec![0u8; size.min(HEAD_LEN as u64) as usize];
    read(&mut head, 0)?;
    let mut tail = None;
    if size >= TAIL_LEN as u64 {
        let mut t = vec![0u8; TAIL_LEN];
        let at = size - TAIL_LEN as u64;
        if at + (TAIL_LEN as u64) <= head.len() as u64 {
            t.copy_from_slice(&head[at as usize..]);
        } else {
            read(&mut t, at)?;
        }
        tail = Some(t);
    }
    Ok(detect(&head, tail.as_deref()))
}

/// What the target looks like (its first and last bytes read).
pub fn probe_target(t: &crate::Target) -> crate::Result<Option<Format>> {
    probe(t.size(), |b, at| t.read_at(b, at))
}

/// The one line that refuses `name` for looking like `f`, for every command
/// that would otherwise read it as raw.
pub fn refusal(name: &str, f: Format) -> String {
    format!(
        "{name} looks like a {f} image, not raw: convert it first (qemu-img convert -O raw), \
         or pass -f raw to read its bytes as raw anyway"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeros_and_short_images_are_raw() {
        assert_eq!(detect(&[0u8; HEAD_LEN], Some(&[0u8; TAIL_LEN])), None);
        assert_eq!(detect(&[], None), None);
        assert_eq!(detect(b"QFI", None), None);
        assert_eq!(detect(b"QFI\xfb", None), None);
    }

    #[test]
    fn qcow_versions() {
        let mut h = b"QFI\xfb\0\0\0\x01".to_vec();
        assert_eq!(detect(&h, None), Some(Format::Qcow));
        h[7] = 3;
        assert_eq!(detect(&h, None), Some(Format::Qcow2));
    }

    #[test]
    fn vmdk_descriptor_lines() {
        let d = b"# Disk DescriptorFile\nversion=1\nCID=fffffffe\n";
        assert_eq!(detect(d, None), Some(Format::Vmdk));
        assert_eq!(detect(b"# a\r\n  version=3\r\n", None), Some(Format::Vmdk));
        assert_eq!(detect(b"# Disk DescriptorFile\nversion=7\n", None), None);
        assert_eq!(detect(b"# just a comment\n", None), None);
    }

    #[test]
    fn trailers() {
        let mut t = vec![0u8; TAIL_LEN];
        t[..8].copy_from_slice(b"conectix");
        assert_eq!(detect(&[0u8; 16], Some(&t)), Some(Format::Vpc));
        let mut k = vec![0u8; TAIL_LEN];
        k[..4].copy_from_slice(b"koly");
        k[4..8].copy_from_slice(&4u32.to_be_bytes());
        k[8..12].copy_from_slice(&512u32.to_be_bytes());
        assert_eq!(detect(&[0u8; 16], Some(&k)), Some(Format::Dmg));
        k[7] = 5;
        assert_eq!(detect(&[0u8; 16], Some(&k)), None);
    }

    #[test]
    fn probe_reads_the_tail_of_a_short_image_from_the_head() {
        let mut img = vec![0u8; 1024];
        img[512..520].copy_from_slice(b"conectix");
        let mut reads = 0;
        let f = probe(img.len() as u64, |b: &mut [u8], at| {
            reads += 1;
            b.copy_from_slice(&img[at as usize..at as usize + b.len()]);
            Ok::<(), ()>(())
        });
        assert_eq!(f, Ok(Some(Format::Vpc)));
        assert_eq!(reads, 1);
    }
}
