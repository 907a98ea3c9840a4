//! Sizes as qemu-img and nbdkit users type them: `10G`, `512`, `1.5T`,
//! `4k`, `64KiB`. Suffixes are binary (1K = 1024), as in qemu-img; `GB` and
//! `MB` are refused as qemu-img refuses them, since they read as decimal.
//! Hexadecimal (`0x1000`) as qemu-img takes it: bytes, no suffix.

/// The largest size: what an off_t holds, as qemu-img's 8 EiB limit.
const MAX_SIZE: u64 = i64::MAX as u64;

fn too_large(s: &str) -> String {
    format!("size '{s}' is too large (at most {MAX_SIZE} bytes, 8E - 1)")
}

/// Parse a size. Plain numbers are bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.is_empty() {
        return Err("empty size".into());
    }
    if t.starts_with('-') {
        return Err(format!("invalid size '{s}': negative size"));
    }
    let hex = t
        .get(..2)
        .is_some_and(|p| p.eq_ignore_ascii_case("0x"))
        .then(|| &t[2..]);
    let split = match hex {
        // B and E are hex digits, as in qemu: 0x1E is 30 bytes.
        Some(h) => 2 + h.find(|c: char| !c.is_ascii_hexdigit()).unwrap_or(h.len()),
        None => t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len()),
    };
    let (num, suffix) = t.split_at(split);
    if hex.is_some() && (num.len() == 2 || !suffix.trim().is_empty()) {
        return Err(format!(
            "invalid size '{s}': a hexadecimal size is a whole number of bytes with no suffix \
             (0x1000), as qemu-img takes it"
        ));
    }
    if num.is_empty() {
        return Err(format!("invalid size '{s}': no number"));
    }
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        "p" | "pib" => 50,
        "e" | "eib" => 60,
        other @ ("kb" | "mb" | "gb" | "tb" | "pb" | "eb") => {
            let unit = other[..1].to_ascii_uppercase();
            return Err(format!(
                "invalid size '{s}': '{}' could mean powers of 1000; write {num}{unit} or {num}{unit}iB (binary, as qemu-img)",
                suffix.trim()
            ));
        }
        other => {
            return Err(format!(
                "invalid size '{s}': unknown suffix '{other}' (use bytes, or K, M, G, T, P, E, optionally followed by iB)"
            ))
        }
    };
    let mult = 1u128 << shift;
    let bytes: u128 = if hex.is_some() {
        u128::from_str_radix(&num[2..], 16)
            .ok()
            .and_then(|v| v.checked_mul(mult))
            .ok_or_else(|| too_large(s))?
    } else if let Some((int, frac)) = num.split_once('.') {
        if frac.contains('.') || (int.is_empty() && frac.is_empty()) {
            return Err(format!("invalid size '{s}'"));
        }
        let int: u128 = if int.is_empty() {
            0
        } else {
            int.parse().map_err(|_| format!("invalid size '{s}'"))?
        };
        let scale = 10u128.pow(frac.len().min(30) as u32);
        let frac_v: u128 = if frac.is_empty() {
            0
        } else {
            frac[..frac.len().min(30)]
                .parse()
                .map_err(|_| format!("invalid size '{s}'"))?
        };
        let total = int
            .checked_mul(mult)
            .and_then(|v| v.checked_add(frac_v.checked_mul(mult)? / scale))
            .ok_or_else(|| too_large(s))?;
        // qemu-img refuses fractional byte counts; so do we.
        if frac_v
            .checked_mul(mult)
            .map(|v| v % scale != 0)
            .unwrap_or(true)
        {
            return Err(format!("invalid size '{s}': not a whole number of bytes"));
        }
        total
    } else {
        num.parse::<u128>()
            .ok()
            .and_then(|v| v.checked_mul(mult))
            .ok_or_else(|| too_large(s))?
    };
    u64::try_from(bytes)
        .ok()
        .filter(|b| *b <= MAX_SIZE)
        .ok_or_else(|| too_large(s))
}

/// For clap's `value_parser`.
pub fn size_arg(s: &str) -> Result<u64, String> {
    parse_size(s)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn plain_and_suffixed() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("512"), Ok(512));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("2M"), Ok(2 << 20));
        assert_eq!(parse_size("10G"), Ok(10 << 30));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("6442450944"), Ok(6442450944));
    }

    #[test]
    fn hexadecimal_as_qemu_img() {
        assert_eq!(parse_size("0x1000"), Ok(4096));
        assert_eq!(parse_size("0X1000"), Ok(4096));
        assert_eq!(parse_size("0x1E"), Ok(30));
        assert!(parse_size("0x10M").unwrap_err().contains("no suffix"));
        assert_eq!(parse_size("0x7fffffffffffffff"), Ok(i64::MAX as u64));
        assert!(parse_size("0x").is_err());
        assert!(parse_size("0x1.8").unwrap_err().contains("whole number"));
        assert!(parse_size("0x8000000000000000")
            .unwrap_err()
            .contains("at most 9223372036854775807 bytes"));
        assert!(parse_size("0xg").is_err());
    }

    #[test]
    fn rejects() {
        assert!(parse_size("").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size("10X").is_err());
        assert!(parse_size("-1").unwrap_err().contains("negative size"));
        assert!(parse_size("10GB").unwrap_err().contains("10G or 10GiB"));
        assert!(parse_size("5mb").is_err());
        assert!(parse_size("1.2.3").is_err());
        assert!(parse_size("0.3").is_err()); // 0.3 bytes
        assert!(parse_size("9E").is_err()); // > i64::MAX
        assert!(parse_size("99999999999999999999999").is_err());
    }
}
