//! What qemu-nbd's FILE names: a file name, a `json:{...}` filename or,
//! with `--image-opts`, `key=value,...` options; and `--object`s. Both
//! structured forms are flattened into dotted keys (`file.filename`), as
//! qemu does, and read as a tree of block nodes: a `raw` format node
//! (`offset`, `size`) over another raw node or over the protocol, `file`
//! or `host_device`. Anything else is not rawdisk's to serve.

use std::collections::BTreeMap;

/// A flattened option tree: dotted key to value.
pub(super) type Flat = BTreeMap<String, String>;

/// The image to serve.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Image {
    pub path: String,
    /// The protocol named: `file`, `host_device`, or None (a plain name).
    pub protocol: Option<&'static str>,
    /// A raw format node was named (no probing for another format).
    pub raw: bool,
    pub offset: u64,
    pub size: Option<u64>,
    /// Node options with a serve meaning: read-only, cache.direct, aio,
    /// discard, detect-zeroes (the last one given wins).
    pub read_only: bool,
    pub direct: bool,
    pub aio: Option<String>,
    pub discard: Option<String>,
    pub detect_zeroes: Option<String>,
}

/// Why an image cannot be served: `Other` is for qemu's qemu-nbd.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Bad {
    /// Malformed, as qemu would refuse it too.
    Invalid(String),
    /// Something rawdisk does not serve.
    Other(String),
}

/// Keys a node may carry that change nothing here (names, locks).
const IGNORED: &[&str] = &["node-name", "locking", "auto-read-only", "cache.no-flush"];

/// `json:{...}` flattened; numbers and booleans as their text.
pub(super) fn json_options(text: &str) -> Result<Flat, Bad> {
    let bad = |e: serde_json::Error| Bad::Invalid(format!("could not parse JSON filename: {e}"));
    // serde_json keeps the last of two equal keys: which file to serve
    // would be a guess. qemu refuses them; so does this, first.
    serde_json::from_str::<NoDuplicateKeys>(text).map_err(bad)?;
    let v: serde_json::Value = serde_json::from_str(text).map_err(bad)?;
    let mut out = Flat::new();
    flatten("", &v, &mut out)?;
    Ok(out)
}

/// Any JSON value, refused when an object names a key twice.
struct NoDuplicateKeys;

impl<'de> serde::Deserialize<'de> for NoDuplicateKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(NoDuplicateKeys)
    }
}

impl<'de> serde::de::Visitor<'de> for NoDuplicateKeys {
    type Value = NoDuplicateKeys;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self, E> {
        Ok(self)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self, E> {
        Ok(self)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self, E> {
        Ok(self)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self, E> {
        Ok(self)
    }
    fn visit_str<E>(self, _: &str) -> Result<Self, E> {
        Ok(self)
    }
    fn visit_unit<E>(self) -> Result<Self, E> {
        Ok(self)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self, A::Error> {
        while seq.next_element::<NoDuplicateKeys>()?.is_some() {}
        Ok(self)
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self, A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(serde::de::Error::custom(format!("duplicate key '{key}'")));
            }
            map.next_value::<NoDuplicateKeys>()?;
        }
        Ok(self)
    }
}

fn flatten(prefix: &str, v: &serde_json::Value, out: &mut Flat) -> Result<(), Bad> {
    use serde_json::Value;
    match v {
        Value::Object(m) => {
            if m.is_empty() && !prefix.is_empty() {
                out.insert(prefix.trim_end_matches('.').to_string(), String::new());
            }
            for (k, v) in m {
                flatten(&format!("{prefix}{k}."), v, out)?;
            }
        }
        Value::String(s) => {
            out.insert(prefix.trim_end_matches('.').to_string(), s.clone());
        }
        Value::Number(n) => {
            out.insert(prefix.trim_end_matches('.').to_string(), n.to_string());
        }
        Value::Bool(b) => {
            out.insert(prefix.trim_end_matches('.').to_string(), b.to_string());
        }
        Value::Null => {
            out.insert(prefix.trim_end_matches('.').to_string(), "null".into());
        }
        Value::Array(_) => {
            return Err(Bad::Other(format!(
                "'{}': lists are not options rawdisk knows",
                prefix.trim_end_matches('.')
            )))
        }
    }
    Ok(())
}

/// qemu's `key=value,key=value` (`,,` is a comma); `implied` names a first
/// element without `=` (qemu's implied key: `qom-type` of `--object`).
pub(super) fn key_values(text: &str, implied: Option<&str>) -> Result<Flat, Bad> {
    let mut parts = Vec::new();
    let mut cur = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                cur.push(',');
            } else {
                parts.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(c);
        }
    }
    parts.push(cur);
    let mut out = Flat::new();
    for (i, p) in parts.into_iter().enumerate() {
        match p.split_once('=') {
            Some((k, v)) => {
                out.insert(k.to_string(), v.to_string());
            }
            None if i == 0 && implied.is_some() => {
                out.insert(implied.unwrap_or_default().to_string(), p);
            }
            None if p.is_empty() => {}
            None => return Err(Bad::Invalid(format!("Invalid parameter '{p}'"))),
        }
    }
    Ok(out)
}

/// A number as qemu_strtou64 reads one: decimal, 0x hexadecimal or 0
/// octal, leading blanks allowed, nothing after it.
pub(super) fn strtou64(s: &str) -> Option<u64> {
    let t = s.trim_start();
    let t = t.strip_prefix('+').unwrap_or(t);
    let (digits, radix) = if let Some(h) = t.strip_prefix("0x").or(t.strip_prefix("0X")) {
        (h, 16)
    } else if t.len() > 1 && t.starts_with('0') {
        (&t[1..], 8)
    } else {
        (t, 10)
    };
    if digits.is_empty() {
        return None;
    }
    u64::from_str_radix(digits, radix).ok()
}

/// An on/off value as qemu's options take it.
fn boolean(key: &str, v: &str) -> Result<bool, Bad> {
    match v {
        "on" | "true" | "yes" | "y" => Ok(true),
        "off" | "false" | "no" | "n" => Ok(false),
        _ => Err(Bad::Invalid(format!(
            "Parameter '{key}' expects 'on' or 'off'"
        ))),
    }
}

/// The image a flattened option tree names.
pub(super) fn from_options(flat: &Flat) -> Result<Image, Bad> {
    let mut img = Image::default();
    node("", flat, &mut img)?;
    Ok(img)
}

/// Reads the node at `prefix` (its keys start with it) into `img`.
fn node(prefix: &str, flat: &Flat, img: &mut Image) -> Result<(), Bad> {
    let key = |k: &str| format!("{prefix}{k}");
    let get = |k: &str| flat.get(&key(k)).map(String::as_str);
    let driver = get("driver");
    // This node's own keys, checked before descending.
    let mine = flat.keys().filter_map(|k| {
        k.strip_prefix(prefix)
            .filter(|rest| !rest.starts_with("file.") && *rest != "file")
    });
    for k in mine {
        let v = flat[&key(k)].as_str();
        match k {
            "driver" | "filename" => {}
            "offset" | "size" if driver == Some("raw") => {}
            "read-only" => img.read_only |= boolean(&key(k), v)?,
            "cache.direct" => img.direct |= boolean(&key(k), v)?,
            "aio" => img.aio = Some(v.to_string()),
            "discard" => {
                if !matches!(v, "ignore" | "off" | "unmap" | "on") {
                    return Err(Bad::Invalid("Invalid discard option".into()));
                }
                img.discard = Some(v.to_string())
            }
            "detect-zeroes" => {
                if !matches!(v, "off" | "on" | "unmap") {
                    return Err(Bad::Invalid(format!("invalid parameter value: {v}")));
                }
                img.detect_zeroes = Some(v.to_string())
            }
            _ if IGNORED.contains(&k) => {}
            _ => {
                return Err(Bad::Other(format!(
                    "option '{}' is not one rawdisk serves",
                    key(k)
                )))
            }
        }
    }
    match driver {
        Some("raw") => {
            img.raw = true;
            let number = |k: &str| -> Result<Option<u64>, Bad> {
                get(k)
                    .map(|v| {
                        strtou64(v).ok_or_else(|| {
                            Bad::Invalid(format!("Parameter '{}' expects a number", key(k)))
                        })
                    })
                    .transpose()
            };
            let (offset, size) = (number("offset")?.unwrap_or(0), number("size")?);
            // What is below: a child node, or a file name for one (qemu
            // takes one or the other; a string `file` names a node).
            let child = flat.keys().any(|k| k.starts_with(&key("file.")));
            match (get("file"), get("filename")) {
                (Some(name), _) => {
                    return Err(Bad::Invalid(format!(
                        "Cannot find device='{name}' nor node-name='{name}'"
                    )))
                }
                (None, Some(_)) if child => {
                    return Err(Bad::Invalid(
                        "Block format 'raw' does not support the option 'filename'".into(),
                    ))
                }
                (None, Some(name)) => img.path = name.to_string(),
                (None, None) => node(&key("file."), flat, img)?,
            }
            // This node's window is within its child's.
            let below = img.size;
            if let Some(b) = below {
                if offset > b || size.is_some_and(|s| offset.checked_add(s).is_none_or(|e| e > b)) {
                    return Err(Bad::Invalid(format!(
                        "The sum of offset ({offset}) and size ({}) has to be smaller or \
                         equal to the actual size of the containing file ({b})",
                        size.unwrap_or(0)
                    )));
                }
            }
            img.offset = img.offset.checked_add(offset).ok_or_else(|| {
                Bad::Invalid(format!("Parameter '{}' is too large", key("offset")))
            })?;
            img.size = size.or(below.map(|b| b - offset));
        }
        Some(p @ ("file" | "host_device")) => {
            img.protocol = Some(if p == "file" { "file" } else { "host_device" });
            img.raw = true;
            match get("filename") {
                Some(f) => img.path = f.to_string(),
                None => {
                    return Err(Bad::Invalid(format!(
                        "Parameter '{}' is required",
                        key("filename")
                    )))
                }
            }
        }
        Some(other) => {
            return Err(Bad::Other(format!(
                "driver '{other}' is not one rawdisk serves (raw over file or host_device)"
            )))
        }
        None if prefix.is_empty() => match get("filename") {
            // A name and options for it: the format is probed.
            Some(f) => img.path = f.to_string(),
            None => return Err(Bad::Invalid("Must specify either driver or file".into())),
        },
        None => {
            return Err(Bad::Invalid(format!(
                "Parameter '{}' is required",
                key("driver")
            )))
        }
    }
    Ok(())
}

/// A plain FILE: `file:` names the file protocol; another `proto:` before
/// any `/` names a protocol rawdisk lacks (nbd:, http:, ...).
pub(super) fn from_name(name: &str) -> Result<Image, Bad> {
    let mut img = Image::default();
    if let Some(rest) = name.strip_prefix("file:") {
        img.path = rest.to_string();
        img.protocol = Some("file");
        return Ok(img);
    }
    if let Some(colon) = name.find(':') {
        if !name[..colon].contains('/') {
            return Err(Bad::Other(format!(
                "protocol '{}:' is not one rawdisk serves",
                &name[..colon]
            )));
        }
    }
    img.path = name.to_string();
    Ok(img)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(s: &str) -> Result<Image, Bad> {
        from_options(&json_options(s)?)
    }

    #[test]
    fn the_stacks_json_filenames() {
        // vdsm, file and block device.
        let i = json(r#"{"driver": "raw", "file": {"driver": "file", "filename": "/p"}}"#).unwrap();
        assert_eq!(
            (i.path.as_str(), i.protocol, i.raw),
            ("/p", Some("file"), true)
        );
        assert_eq!((i.offset, i.size), (0, None));
        let i = json(r#"{"driver":"raw","file":{"driver":"host_device","filename":"/dev/x"}}"#)
            .unwrap();
        assert_eq!(i.protocol, Some("host_device"));
        // imageio's slice; and a raw node over a raw slice.
        let i = json(
            r#"{"driver":"raw","file":{"driver":"file","filename":"/p"},"offset":4096,"size":8192}"#,
        )
        .unwrap();
        assert_eq!((i.offset, i.size), (4096, Some(8192)));
        let i = json(
            r#"{"driver":"raw","offset":512,"file":{"driver":"raw","offset":4096,"size":8192,
                "file":{"driver":"file","filename":"/p"}}}"#,
        )
        .unwrap();
        assert_eq!((i.offset, i.size), (4608, Some(7680)));
        assert!(matches!(
            json(
                r#"{"driver":"raw","offset":9000,"file":{"driver":"raw","size":8192,
                "file":{"driver":"file","filename":"/p"}}}"#
            ),
            Err(Bad::Invalid(_))
        ));
        // Other formats and drivers are qemu's.
        for bad in [
            r#"{"driver":"qcow2","file":{"driver":"file","filename":"/p"}}"#,
            r#"{"driver":"raw","file":{"driver":"nbd","path":"/s"}}"#,
            r#"{"driver":"raw","file":{"driver":"file","filename":"/p","x-unknown":1}}"#,
        ] {
            assert!(matches!(json(bad), Err(Bad::Other(_))), "{bad}");
        }
    }

    #[test]
    fn image_opts_and_objects() {
        let f = key_values(
            "driver=raw,offset=0x1000,file.driver=file,file.filename=/a,,b",
            None,
        )
        .unwrap();
        let i = from_options(&f).unwrap();
        assert_eq!((i.path.as_str(), i.offset), ("/a,b", 4096));
        let o = key_values(
            "tls-creds-x509,id=tls0,endpoint=server,dir=/d,verify-peer=false",
            Some("qom-type"),
        )
        .unwrap();
        assert_eq!(o["qom-type"], "tls-creds-x509");
        assert_eq!(o["dir"], "/d");
        assert_eq!(strtou64(" 0x10"), Some(16));
        assert_eq!(strtou64("010"), Some(8));
        assert_eq!(strtou64("1x"), None);
        assert_eq!(
            from_name("nbd:unix:/s"),
            Err(Bad::Other(
                "protocol 'nbd:' is not one rawdisk serves".into()
            ))
        );
        assert_eq!(from_name("./a:b").unwrap().path, "./a:b");
        assert_eq!(from_name("file:/a").unwrap().path, "/a");
    }

    /// What qemu's qemu-nbd refuses is refused, not read some other way: a
    /// node that names its file twice, a node reference where only files
    /// exist, a value qemu does not take, and sums past 2^64.
    #[test]
    fn nodes_qemu_refuses() {
        let file = r#""file":{"driver":"file","filename":"/p"}"#;
        for bad in [
            // Which file is served: /q, or the child's /p?
            format!(r#"{{"driver":"raw","filename":"/q",{file}}}"#),
            r#"{"driver":"raw","filename":"/q","file.driver":"file"}"#.to_string(),
            // A node name, not a file name.
            r#"{"driver":"raw","file":"/p"}"#.to_string(),
            // Typos qemu refuses; served as if not given they would be
            // a detect-zeroes or discard silently off.
            format!(r#"{{"driver":"raw",{file},"detect-zeroes":"unamp"}}"#),
            format!(r#"{{"driver":"raw",{file},"discard":"bogus"}}"#),
            // offset + size wraps past 2^64 over a child's size.
            // Which file: /p or /q?
            r#"{"driver":"raw","file":{"driver":"file","filename":"/p","filename":"/q"}}"#
                .to_string(),
            r#"{"driver":"raw","file":{"driver":"file","filename":"/p"},"driver":"raw"}"#
                .to_string(),
            r#"{"driver":"raw","offset":1,"size":18446744073709551615,
               "file":{"driver":"raw","size":8192,"file":{"driver":"file","filename":"/p"}}}"#
                .to_string(),
        ] {
            assert!(matches!(json(&bad), Err(Bad::Invalid(_))), "{bad}");
        }
        // The same nodes written right are taken.
        let i = json(&format!(
            r#"{{"driver":"raw",{file},"detect-zeroes":"unmap","discard":"on"}}"#
        ))
        .unwrap();
        assert_eq!(i.detect_zeroes.as_deref(), Some("unmap"));
        assert_eq!(
            json(r#"{"driver":"raw","filename":"/q"}"#).unwrap().path,
            "/q"
        );
    }
}
