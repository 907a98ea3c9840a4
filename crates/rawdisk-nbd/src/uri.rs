//! NBD URIs as the NBD URI specification defines them (`doc/uri.md` in the
//! NBD project, <https://github.com/NetworkBlockDevice/nbd/blob/master/doc/uri.md>):
//! `nbd://host[:port]/export` and `nbd+unix:///export?socket=PATH`, and
//! their TLS forms `nbds://` and `nbds+unix://` with the spec's `tls-*`
//! query parameters plus libnbd's `tls-certificates` and `tls-psk-file`.
//! The `tls-*` parameters are refused on `nbd://`: TLS there would be
//! opportunistic, and a URI that names credentials means TLS or nothing.

use std::fmt;
use std::path::PathBuf;

pub use crate::tls::TlsParams;

/// The IANA-assigned NBD port, the default when a TCP URI has none.
pub const DEFAULT_PORT: u16 = 10809;

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    /// `host` is a name or an address; IPv6 literals without brackets.
    Tcp {
        host: String,
        port: u16,
    },
    Unix {
        path: PathBuf,
    },
}

/// A parsed NBD URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    pub transport: Transport,
    /// The export name: the path without its leading `/`, percent-decoded.
    pub export: String,
    /// `nbds://`, `nbds+unix://`: TLS or no connection.
    pub tls: Option<TlsParams>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UriError {
    #[error("'{0}' is not an NBD URI (expected nbd://host[:port]/export or nbd+unix:///export?socket=PATH)")]
    NotNbd(String),
    #[error("'{uri}': {what} needs a TLS URI (nbds:// or nbds+unix://)")]
    Tls { uri: String, what: String },
    #[error("'{uri}': unsupported NBD transport '{scheme}' (use nbd:// or nbd+unix://)")]
    Unsupported { uri: String, scheme: String },
    #[error("'{uri}': {why}")]
    Invalid { uri: String, why: String },
}

/// The query parameters this parser understands (URI spec: "Query
/// parameters"), for the "did you mean" of a typo.
const QUERY_PARAMS: &[&str] = &[
    "socket",
    "tls-certificates",
    "tls-psk-file",
    "tls-hostname",
    "tls-verify-peer",
    "tls-type",
];

/// The known parameter a typo most likely meant: a prefix of it (`sock`), or
/// at most two edits away (`sokcet`).
fn closest_param(k: &str) -> Option<&'static str> {
    QUERY_PARAMS
        .iter()
        .map(|p| (edit_distance(k, p), *p))
        .filter(|(d, p)| *d <= 2 || (k.len() >= 3 && p.starts_with(k)))
        .min_by_key(|(d, _)| *d)
        .map(|(_, p)| p)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Whether `s` looks like an NBD URI (any `nbd…:` scheme), so callers can
/// decide between a local path and a URI before parsing. A local file whose
/// name starts with `nbd:` can still be named as `./nbd:…`.
pub fn looks_like_nbd_uri(s: &str) -> bool {
    match s.split_once(':') {
        Some((scheme, _)) => {
            let scheme = scheme.to_ascii_lowercase();
            scheme == "nbd"
                || scheme == "nbds"
                || scheme.starts_with("nbd+")
                || scheme.starts_with("nbds+")
        }
        None => false,
    }
}

impl NbdUri {
    /// qemu's legacy form, which libvirt and old scripts still write:
    /// `nbd:unix:PATH[:exportname=NAME]` or `nbd:HOST[:PORT][:exportname=NAME]`
    /// (no percent-encoding, no TLS); None when `uri` is not one.
    fn parse_legacy(uri: &str) -> Option<Result<NbdUri, UriError>> {
        let rest = uri
            .get(..4)?
            .eq_ignore_ascii_case("nbd:")
            .then(|| &uri[4..])?;
        if rest.starts_with("//") {
            return None;
        }
        let invalid = |why: String| UriError::Invalid {
            uri: uri.to_string(),
            why,
        };
        let (addr, export) = match rest.split_once(":exportname=") {
            Some((a, e)) => (a, e.to_string()),
            None => (rest, String::new()),
        };
        let transport = match addr.strip_prefix("unix:") {
            Some("") => return Some(Err(invalid("empty socket path".into()))),
            Some(path) => Transport::Unix { path: path.into() },
            None if addr.is_empty() => return Some(Err(invalid("no host".into()))),
            None => {
                let (host, port) = match split_host_port(addr) {
                    Ok(hp) => hp,
                    Err(why) => return Some(Err(invalid(why))),
                };
                Transport::Tcp {
                    host: host.to_string(),
                    port,
                }
            }
        };
        Some(Ok(NbdUri {
            transport,
            export,
            tls: None,
        }))
    }

    pub fn parse(uri: &str) -> Result<NbdUri, UriError> {
        if let Some(legacy) = NbdUri::parse_legacy(uri) {
            return legacy;
        }
        let invalid = |why: &str| UriError::Invalid {
            uri: uri.to_string(),
            why: why.to_string(),
        };
        let (scheme, rest) = uri
            .split_once("://")
            .ok_or_else(|| UriError::NotNbd(uri.to_string()))?;
        let scheme_lc = scheme.to_ascii_lowercase();
        let (unix, tls) = match scheme_lc.as_str() {
            "nbd" => (false, false),
            "nbd+unix" => (true, false),
            "nbds" => (false, true),
            "nbds+unix" => (true, true),
            s if s.starts_with("nbd+") || s.starts_with("nbds+") => {
                return Err(UriError::Unsupported {
                    uri: uri.to_string(),
                    scheme: scheme.to_string(),
                })
            }
            _ => return Err(UriError::NotNbd(uri.to_string())),
        };
        // RFC 3986: the fragment is not sent anywhere; NBD gives it no meaning.
        let rest = match rest.split_once('#') {
            Some((r, _)) => r,
            None => rest,
        };
        let (hier, query) = match rest.split_once('?') {
            Some((h, q)) => (h, Some(q)),
            None => (rest, None),
        };
        let (authority, path) = match hier.find('/') {
            Some(i) => (&hier[..i], &hier[i..]),
            None => (hier, ""),
        };
        let export = match path.strip_prefix('/') {
            Some(p) => percent_decode(p).map_err(|e| invalid(&format!("export name: {e}")))?,
            None => String::new(),
        };
        if export.contains('\0') {
            return Err(invalid("export name contains NUL"));
        }

        let mut socket: Option<String> = None;
        let mut tls_params = TlsParams {
            verify_peer: true,
            ..Default::default()
        };
        let mut tls_type: Option<String> = None;
        if let Some(q) = query {
            for pair in q.split('&').filter(|p| !p.is_empty()) {
                let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                let k = percent_decode(k).map_err(|e| invalid(&e))?;
                let v = percent_decode(v).map_err(|e| invalid(&e))?;
                match k.as_str() {
                    "socket" if unix => {
                        if socket.replace(v).is_some() {
                            return Err(invalid("'socket' given twice"));
                        }
                    }
                    "socket" => {
                        return Err(invalid(
                            "'socket' is only valid with nbd+unix:// (did you mean nbd+unix:///export?socket=PATH?)",
                        ))
                    }
                    k if k.starts_with("tls-") && !tls => {
                        return Err(UriError::Tls {
                            uri: uri.to_string(),
                            what: format!("query parameter '{k}'"),
                        })
                    }
                    "tls-certificates" => tls_params.certificates = Some(PathBuf::from(v)),
                    "tls-psk-file" => tls_params.psk_file = Some(PathBuf::from(v)),
                    "tls-hostname" => tls_params.hostname = Some(v),
                    "tls-verify-peer" => {
                        tls_params.verify_peer = match v.as_str() {
                            "1" | "true" | "on" | "yes" => true,
                            "0" | "false" | "off" | "no" => false,
                            _ => return Err(invalid("tls-verify-peer takes 0 or 1")),
                        }
                    }
                    "tls-type" => tls_type = Some(v),
                    k if k.starts_with("x-") => {
                        // Experimental parameters of other clients (spec: "x-"
                        // prefix); nothing here understands them.
                        tracing::debug!(param = k, "ignoring experimental NBD URI parameter");
                    }
                    other => {
                        let hint = match closest_param(other) {
                            Some(k) => format!(" (did you mean \"{k}\"?)"),
                            None => String::new(),
                        };
                        return Err(invalid(&format!("unknown query parameter '{other}'{hint}")));
                    }
                }
            }
        }

        // userinfo: the PSK identity (URI spec: "NBD URI authority").
        let hostport = match authority.rsplit_once('@') {
            Some((user, hp)) => {
                let user = user.split_once(':').map_or(user, |(u, _)| u);
                tls_params.username = Some(percent_decode(user).map_err(|e| invalid(&e))?);
                hp
            }
            None => authority,
        };
        match tls_type.as_deref() {
            None => {}
            Some("x509") if tls_params.psk_file.is_none() => {}
            Some("psk") if tls_params.psk_file.is_some() => {}
            Some("x509") => return Err(invalid("tls-type=x509 with tls-psk-file")),
            Some("psk") => return Err(invalid("tls-type=psk needs tls-psk-file=FILE")),
            Some("anon") => {
                return Err(invalid("tls-type=anon is not supported (use x509 or psk)"))
            }
            Some(t) => return Err(invalid(&format!("unknown tls-type '{t}' (x509 or psk)"))),
        }
        if tls_params.certificates.is_some() && tls_params.psk_file.is_some() {
            return Err(invalid(
                "tls-certificates and tls-psk-file are alternatives: give one",
            ));
        }

        let transport = if unix {
            if !hostport.is_empty() {
                return Err(invalid(
                    "nbd+unix:// takes no host (write nbd+unix:///export?socket=PATH, three slashes)",
                ));
            }
            let path = socket.ok_or_else(|| invalid("nbd+unix:// needs ?socket=PATH"))?;
            if path.is_empty() {
                return Err(invalid("empty socket path"));
            }
            if path.starts_with('\0') {
                return Err(invalid("abstract Unix sockets are not supported"));
            }
            Transport::Unix {
                path: PathBuf::from(path),
            }
        } else {
            let (host, port) = split_host_port(hostport).map_err(|e| invalid(&e))?;
            let host = percent_decode(host).map_err(|e| invalid(&e))?;
            if host.is_empty() {
                return Err(invalid("nbd:// needs a host (e.g. nbd://localhost/export)"));
            }
            Transport::Tcp { host, port }
        };
        Ok(NbdUri {
            transport,
            export,
            tls: tls.then_some(tls_params),
        })
    }
}

fn split_host_port(hp: &str) -> Result<(&str, u16), String> {
    let parse_port = |p: &str| -> Result<u16, String> {
        if p.is_empty() {
            return Ok(DEFAULT_PORT);
        }
        p.parse::<u16>()
            .ok()
            .filter(|&n| n != 0)
            .ok_or_else(|| format!("invalid port '{p}'"))
    };
    if let Some(rest) = hp.strip_prefix('[') {
        // RFC 2732 IPv6 literal.
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| "unterminated '[' in host".to_string())?;
        let port = match after {
            "" => DEFAULT_PORT,
            a => parse_port(
                a.strip_prefix(':')
                    .ok_or_else(|| format!("junk '{a}' after ']'"))?,
            )?,
        };
        return Ok((host, port));
    }
    match hp.rsplit_once(':') {
        Some((h, p)) => {
            if h.contains(':') {
                return Err(
                    "IPv6 addresses must be written in brackets: nbd://[::1]:10809/".into(),
                );
            }
            Ok((h, parse_port(p)?))
        }
        None => Ok((hp, DEFAULT_PORT)),
    }
}

fn percent_decode(s: &str) -> Result<String, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent escape in '{s}'"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("'{s}' is not UTF-8 after percent-decoding"))
}

fn percent_encode(s: &str, keep: &[u8]) -> String {
    let mut out = String::with_capacity(s.len());
    for &c in s.as_bytes() {
        if c.is_ascii_alphanumeric() || b"-._~".contains(&c) || keep.contains(&c) {
            out.push(c as char);
        } else {
            out.push_str(&format!("%{c:02X}"));
        }
    }
    out
}

impl fmt::Display for NbdUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let export = percent_encode(&self.export, b"/");
        let s = if self.tls.is_some() { "s" } else { "" };
        let user = match self.tls.as_ref().and_then(|t| t.username.as_deref()) {
            Some(u) => format!("{}@", percent_encode(u, b"")),
            None => String::new(),
        };
        let mut query = Vec::new();
        if let Transport::Unix { path } = &self.transport {
            query.push(("socket", path.to_string_lossy().into_owned()));
        }
        if let Some(t) = &self.tls {
            if let Some(d) = &t.certificates {
                query.push(("tls-certificates", d.to_string_lossy().into_owned()));
            }
            if let Some(p) = &t.psk_file {
                query.push(("tls-psk-file", p.to_string_lossy().into_owned()));
            }
            if let Some(h) = &t.hostname {
                query.push(("tls-hostname", h.clone()));
            }
            if !t.verify_peer {
                query.push(("tls-verify-peer", "0".into()));
            }
        }
        match &self.transport {
            Transport::Tcp { host, port } => {
                let host = if host.contains(':') {
                    format!("[{host}]")
                } else {
                    host.clone()
                };
                if *port == DEFAULT_PORT {
                    write!(f, "nbd{s}://{user}{host}/{export}")?;
                } else {
                    write!(f, "nbd{s}://{user}{host}:{port}/{export}")?;
                }
            }
            Transport::Unix { .. } => write!(f, "nbd{s}+unix://{user}/{export}")?,
        }
        for (i, (k, v)) in query.iter().enumerate() {
            let sep = if i == 0 { '?' } else { '&' };
            write!(f, "{sep}{k}={}", percent_encode(v, b"/"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(host: &str, port: u16, export: &str) -> NbdUri {
        NbdUri {
            transport: Transport::Tcp {
                host: host.into(),
                port,
            },
            export: export.into(),
            tls: None,
        }
    }

    #[test]
    fn spec_export_name_table() {
        // The table in the NBD URI specification, "NBD URI export name".
        let cases = [
            ("nbd://example.com/disk", "disk"),
            ("nbd://example.com/", ""),
            ("nbd://example.com", ""),
            ("nbd://example.com//disk", "/disk"),
            ("nbd://example.com/hello%20world", "hello world"),
        ];
        for (u, e) in cases {
            assert_eq!(
                NbdUri::parse(u).unwrap(),
                tcp("example.com", 10809, e),
                "{u}"
            );
        }
        let u = NbdUri::parse("nbd+unix:///disk?socket=sock").unwrap();
        assert_eq!(
            u,
            NbdUri {
                transport: Transport::Unix {
                    path: "sock".into()
                },
                export: "disk".into(),
                tls: None,
            }
        );
    }

    #[test]
    fn ports_and_ipv6() {
        assert_eq!(
            NbdUri::parse("nbd://h:1234/e").unwrap(),
            tcp("h", 1234, "e")
        );
        assert_eq!(
            NbdUri::parse("nbd://[::1]:99/").unwrap(),
            tcp("::1", 99, "")
        );
        assert_eq!(NbdUri::parse("nbd://[::1]").unwrap(), tcp("::1", 10809, ""));
        assert_eq!(
            NbdUri::parse("nbd://127.0.0.1:").unwrap(),
            tcp("127.0.0.1", 10809, "")
        );
        assert_eq!(
            NbdUri::parse("nbd://user@h/x").unwrap(),
            tcp("h", 10809, "x")
        );
        assert!(NbdUri::parse("nbd://h:0/").is_err());
        assert!(NbdUri::parse("nbd://h:70000/").is_err());
        assert!(NbdUri::parse("nbd://h:x/").is_err());
        assert!(NbdUri::parse("nbd://::1/").is_err());
        assert!(NbdUri::parse("nbd:///e").is_err());
    }

    #[test]
    fn unix_socket() {
        let u = NbdUri::parse("nbd+unix:///?socket=/tmp/a%20b.sock").unwrap();
        assert_eq!(
            u.transport,
            Transport::Unix {
                path: "/tmp/a b.sock".into()
            }
        );
        assert_eq!(u.export, "");
        assert!(NbdUri::parse("nbd+unix:///e").is_err());
        assert!(NbdUri::parse("nbd+unix://host/e?socket=/s").is_err());
        assert!(NbdUri::parse("nbd+unix:///?socket=%00abs").is_err());
        assert!(NbdUri::parse("nbd://h/?socket=/s").is_err());
        assert!(NbdUri::parse("nbd+unix:///?socket=/s&socket=/t").is_err());
    }

    #[test]
    fn tls_parameters_need_a_tls_scheme() {
        for u in [
            "nbd://h/e?tls-type=x509",
            "nbd+unix:///e?socket=/s&tls-verify-peer=0",
            "nbd://h/e?tls-certificates=/pki",
        ] {
            let e = NbdUri::parse(u).unwrap_err();
            assert!(matches!(e, UriError::Tls { .. }), "{u}: {e}");
            assert!(e.to_string().contains("nbds://"), "{e}");
        }
        for u in ["nbd+vsock:///e", "nbds+vsock:///e"] {
            assert!(
                matches!(NbdUri::parse(u).unwrap_err(), UriError::Unsupported { .. }),
                "{u}"
            );
        }
    }

    #[test]
    fn tls_uris() {
        let u = NbdUri::parse("nbds://h/e").unwrap();
        assert_eq!(u.transport, tcp("h", 10809, "e").transport);
        let t = u.tls.unwrap();
        assert!(t.verify_peer && t.certificates.is_none() && t.username.is_none());

        let u = NbdUri::parse("nbds+unix://alice@/disk?socket=/s&tls-psk-file=/k%20s&tls-type=psk")
            .unwrap();
        assert_eq!(u.transport, Transport::Unix { path: "/s".into() });
        let t = u.tls.as_ref().unwrap();
        assert_eq!(t.username.as_deref(), Some("alice"));
        assert_eq!(t.psk_file.as_deref(), Some(std::path::Path::new("/k s")));

        let u =
            NbdUri::parse("NBDS://h:99/e?tls-certificates=/pki&tls-hostname=srv&tls-verify-peer=0")
                .unwrap();
        let t = u.tls.as_ref().unwrap();
        assert_eq!(
            t.certificates.as_deref(),
            Some(std::path::Path::new("/pki"))
        );
        assert_eq!(t.hostname.as_deref(), Some("srv"));
        assert!(!t.verify_peer);

        for bad in [
            "nbds://h/e?tls-certificates=/a&tls-psk-file=/b",
            "nbds://h/e?tls-type=anon",
            "nbds://h/e?tls-type=psk",
            "nbds://h/e?tls-type=x509&tls-psk-file=/b",
            "nbds://h/e?tls-type=srp",
            "nbds://h/e?tls-verify-peer=maybe",
            "nbds://h/e?tls-priority=NORMAL",
            "nbds+unix:///e",
        ] {
            assert!(NbdUri::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn unknown_params_and_junk() {
        assert!(NbdUri::parse("nbd://h/e?foo=1").is_err());
        assert!(NbdUri::parse("nbd://h/e?x-foo=1").is_ok());
        assert!(NbdUri::parse("nbd://h/%zz").is_err());
        assert!(NbdUri::parse("nbd://h/a%00b").is_err());
        assert!(matches!(
            NbdUri::parse("http://h/").unwrap_err(),
            UriError::NotNbd(_)
        ));
        assert!(matches!(
            NbdUri::parse("/dev/sda").unwrap_err(),
            UriError::NotNbd(_)
        ));
    }

    #[test]
    fn qemu_legacy_forms() {
        let p = |u: &str| NbdUri::parse(u).unwrap();
        let unix = |path: &str, export: &str| NbdUri {
            transport: Transport::Unix { path: path.into() },
            export: export.into(),
            tls: None,
        };
        assert_eq!(p("nbd:unix:/tmp/s.sock"), unix("/tmp/s.sock", ""));
        assert_eq!(
            p("nbd:unix:/tmp/s.sock:exportname=vm"),
            unix("/tmp/s.sock", "vm")
        );
        assert_eq!(p("nbd:localhost:10810"), tcp("localhost", 10810, ""));
        assert_eq!(
            p("NBD:10.0.0.1:10809:exportname=a b"),
            tcp("10.0.0.1", 10809, "a b")
        );
        assert_eq!(p("nbd:[::1]:99:exportname=e"), tcp("::1", 99, "e"));
        assert_eq!(p("nbd:host"), tcp("host", DEFAULT_PORT, ""));
        assert!(looks_like_nbd_uri("nbd:unix:/tmp/s.sock"));
        for bad in ["nbd:", "nbd:unix:", "nbd:h:99999", "nbd:h:x"] {
            assert!(NbdUri::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn detection() {
        assert!(looks_like_nbd_uri("nbd://h/e"));
        assert!(looks_like_nbd_uri("NBD+unix:///e?socket=s"));
        assert!(looks_like_nbd_uri("nbds://h/"));
        assert!(!looks_like_nbd_uri("/tmp/nbd:x"));
        assert!(!looks_like_nbd_uri("disk.img"));
    }

    #[test]
    fn display_round_trips() {
        for u in [
            "nbd://example.com/disk",
            "nbd://h:1234/a%20b",
            "nbd://[::1]:99/",
            "nbd+unix:///e?socket=/tmp/x.sock",
            "nbds://h/e",
            "nbds://bob@h:99/e?tls-psk-file=/k&tls-verify-peer=0",
            "nbds+unix:///e?socket=/s&tls-certificates=/pki&tls-hostname=srv",
        ] {
            let p = NbdUri::parse(u).unwrap();
            assert_eq!(p.to_string(), u);
            assert_eq!(NbdUri::parse(&p.to_string()).unwrap(), p);
        }
    }
}
