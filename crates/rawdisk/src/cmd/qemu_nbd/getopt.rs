//! GNU getopt_long as qemu-nbd calls it: short options in clusters (`-rt`)
//! with their values attached (`-t"-e 2"` is `-e` with " 2") or in the next
//! word; long options by any unambiguous prefix, with `=VALUE` or the next
//! word; operands anywhere (permuted to the end) unless POSIXLY_CORRECT is
//! set; `--` ends the options. The messages are glibc's.

/// One option: its long name (the key the caller matches on), its short
/// letter, whether it takes a value.
#[derive(Debug, Clone, Copy)]
pub(super) struct Opt {
    pub long: &'static str,
    pub short: Option<char>,
    pub value: bool,
}

/// What was given: options in order, each with its value, and operands.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Parsed {
    pub opts: Vec<(&'static str, Option<String>)>,
    pub operands: Vec<String>,
}

/// Parses `args` (without the program name) against `table`.
pub(super) fn parse(args: &[String], table: &[Opt], posix: bool) -> Result<Parsed, String> {
    let mut out = Parsed::default();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        i += 1;
        if a == "--" {
            out.operands.extend(args[i..].iter().cloned());
            break;
        }
        if let Some(body) = a.strip_prefix("--") {
            let (name, inline) = match body.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (body, None),
            };
            let o = find_long(name, table)?;
            let value = match (o.value, inline) {
                (false, Some(_)) => {
                    return Err(format!("option '--{}' doesn't allow an argument", o.long))
                }
                (false, None) => None,
                (true, Some(v)) => Some(v),
                (true, None) => match args.get(i) {
                    Some(v) => {
                        i += 1;
                        Some(v.clone())
                    }
                    None => return Err(format!("option '--{}' requires an argument", o.long)),
                },
            };
            out.opts.push((o.long, value));
            continue;
        }
        match a.strip_prefix('-') {
            Some(cluster) if !cluster.is_empty() => {
                let chars = cluster.char_indices();
                for (at, c) in chars {
                    let Some(o) = table.iter().find(|o| o.short == Some(c)) else {
                        return Err(format!("invalid option -- '{c}'"));
                    };
                    if !o.value {
                        out.opts.push((o.long, None));
                        continue;
                    }
                    let rest = &cluster[at + c.len_utf8()..];
                    let value = if !rest.is_empty() {
                        rest.to_string()
                    } else if let Some(v) = args.get(i) {
                        i += 1;
                        v.clone()
                    } else {
                        return Err(format!("option requires an argument -- '{c}'"));
                    };
                    out.opts.push((o.long, Some(value)));
                    break;
                }
            }
            // A word that is not an option ("-" included): an operand.
            _ if posix => {
                out.operands.extend(args[i - 1..].iter().cloned());
                break;
            }
            _ => out.operands.push(a.clone()),
        }
    }
    Ok(out)
}

/// The long option `name` names: itself, or the only option it is a
/// prefix of.
fn find_long(name: &str, table: &[Opt]) -> Result<Opt, String> {
    if let Some(o) = table.iter().find(|o| o.long == name) {
        return Ok(*o);
    }
    let found: Vec<&Opt> = if name.is_empty() {
        Vec::new()
    } else {
        table.iter().filter(|o| o.long.starts_with(name)).collect()
    };
    match found.as_slice() {
        [] => Err(format!("unrecognized option '--{name}'")),
        [o] => Ok(**o),
        many => Err(format!(
            "option '--{name}' is ambiguous; possibilities:{}",
            many.iter()
                .map(|o| format!(" '--{}'", o.long))
                .collect::<String>()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: &[Opt] = &[
        Opt {
            long: "read-only",
            short: Some('r'),
            value: false,
        },
        Opt {
            long: "persistent",
            short: Some('t'),
            value: false,
        },
        Opt {
            long: "shared",
            short: Some('e'),
            value: true,
        },
        Opt {
            long: "socket",
            short: Some('k'),
            value: true,
        },
        Opt {
            long: "export-name",
            short: Some('x'),
            value: true,
        },
        Opt {
            long: "discard",
            short: None,
            value: true,
        },
        Opt {
            long: "detect-zeroes",
            short: None,
            value: true,
        },
    ];

    fn p(args: &[&str]) -> Result<Parsed, String> {
        let a: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        parse(&a, T, false)
    }

    fn opts(args: &[&str]) -> Vec<(&'static str, Option<String>)> {
        p(args).unwrap().opts
    }

    #[test]
    fn values_attached_or_separate() {
        let want = vec![("shared", Some(" 2".to_string()))];
        assert_eq!(opts(&["-e 2"]), want, "a value with a leading space");
        assert_eq!(opts(&["-e", " 2"]), want);
        assert_eq!(opts(&["--shared= 2"]), want);
        assert_eq!(opts(&["--shared", " 2"]), want);
        // A cluster: flags, then one taking the rest of the word.
        assert_eq!(
            opts(&["-rtk/s"]),
            vec![
                ("read-only", None),
                ("persistent", None),
                ("socket", Some("/s".into()))
            ]
        );
        // The next word is the value whatever it looks like.
        assert_eq!(
            opts(&["-x", "-r"]),
            vec![("export-name", Some("-r".into()))]
        );
        assert_eq!(
            opts(&["--export-name="]),
            vec![("export-name", Some(String::new()))]
        );
    }

    #[test]
    fn prefixes_operands_and_the_end_of_options() {
        assert_eq!(opts(&["--read"]), vec![("read-only", None)]);
        assert_eq!(
            opts(&["--di=unmap"]),
            vec![("discard", Some("unmap".into()))]
        );
        let e = p(&["--d=x"]).unwrap_err();
        assert_eq!(
            e,
            "option '--d' is ambiguous; possibilities: '--discard' '--detect-zeroes'"
        );
        let r = p(&["-x", "n", "FILE", "-k", "S", "-t", "--"]).unwrap();
        assert_eq!(r.operands, vec!["FILE"]);
        assert_eq!(r.opts.len(), 3);
        let r = p(&["--", "-r"]).unwrap();
        assert_eq!(r.operands, vec!["-r"]);
        assert!(r.opts.is_empty());
        let a: Vec<String> = ["F", "-r"].iter().map(|s| s.to_string()).collect();
        assert_eq!(parse(&a, T, true).unwrap().operands, vec!["F", "-r"]);
        assert_eq!(p(&["-"]).unwrap().operands, vec!["-"]);
    }

    #[test]
    fn glibc_messages() {
        assert_eq!(p(&["--nope"]).unwrap_err(), "unrecognized option '--nope'");
        assert_eq!(p(&["-z"]).unwrap_err(), "invalid option -- 'z'");
        assert_eq!(
            p(&["-k"]).unwrap_err(),
            "option requires an argument -- 'k'"
        );
        assert_eq!(
            p(&["--socket"]).unwrap_err(),
            "option '--socket' requires an argument"
        );
        assert_eq!(
            p(&["--read-only=1"]).unwrap_err(),
            "option '--read-only' doesn't allow an argument"
        );
    }
}
