//! Flags whose value is optional (`--write-behind[=WHEN]`, `--map[=CONTEXT]`,
//! `--progress[=FD]`) take it attached only, as getopt_long's optional
//! arguments: `--write-behind disk.img` is the flag alone and a target. A
//! word after such a flag is therefore an argument of its own, which is
//! rarely what was meant when it is one of the flag's values: say so.

/// Such a flag followed by a separate word.
pub struct Detached {
    /// The flag's long spelling (`--write-behind`).
    pub flag: String,
    pub word: String,
    /// The word is one of the flag's possible values (`on`): taking it as
    /// a file name would be a guess, so the command line is refused.
    pub is_value: bool,
}

impl Detached {
    pub fn hint(&self) -> String {
        format!(
            "{} takes its value attached: use {}={}",
            self.flag, self.flag, self.word
        )
    }
}

/// The first optional-value flag in `args` (without the program name)
/// followed by a word that does not start with `-`.
pub fn find(root: &clap::Command, args: &[String]) -> Option<Detached> {
    let mut cmd = root.clone();
    for (i, a) in args.iter().enumerate() {
        if a == "--" {
            break;
        }
        let arg = if let Some(long) = a.strip_prefix("--") {
            cmd.get_arguments().find(|x| {
                x.get_long() == Some(long) || x.get_all_aliases().is_some_and(|v| v.contains(&long))
            })
        } else if let Some(short) = a.strip_prefix('-').filter(|s| s.chars().count() == 1) {
            let c = short.chars().next()?;
            cmd.get_arguments().find(|x| {
                x.get_short() == Some(c)
                    || x.get_all_short_aliases().is_some_and(|v| v.contains(&c))
            })
        } else {
            if let Some(sub) = cmd.find_subcommand(a) {
                cmd = sub.clone();
            }
            continue;
        };
        let Some(arg) = arg else { continue };
        let optional =
            arg.is_require_equals_set() && arg.get_num_args().is_some_and(|n| n.min_values() == 0);
        let Some(word) = args.get(i + 1).filter(|w| !w.starts_with('-')) else {
            continue;
        };
        if !optional {
            continue;
        }
        let flag = arg
            .get_long()
            .map_or_else(|| a.clone(), |l| format!("--{l}"));
        let is_value = arg
            .get_possible_values()
            .iter()
            .any(|p| p.matches(word, false));
        return Some(Detached {
            flag,
            word: word.clone(),
            is_value,
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli() -> clap::Command {
        clap::Command::new("t").subcommand(
            clap::Command::new("serve")
                .arg(
                    clap::Arg::new("wb")
                        .long("write-behind")
                        .num_args(0..=1)
                        .require_equals(true)
                        .default_missing_value("on")
                        .value_parser(["on", "off", "auto"]),
                )
                .arg(clap::Arg::new("socket").short('U').long("socket"))
                .arg(clap::Arg::new("target")),
        )
    }

    fn find_in(args: &[&str]) -> Option<(String, String, bool)> {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        find(&cli(), &args).map(|d| (d.flag, d.word, d.is_value))
    }

    #[test]
    fn a_mode_after_the_flag_is_found_a_file_is_not_a_mode() {
        let on = Some(("--write-behind".into(), "on".into(), true));
        assert_eq!(find_in(&["serve", "--write-behind", "on", "d.img"]), on);
        let file = Some(("--write-behind".into(), "d.img".into(), false));
        assert_eq!(find_in(&["serve", "--write-behind", "d.img"]), file);
        assert_eq!(find_in(&["serve", "--write-behind=on", "d.img"]), None);
        assert_eq!(find_in(&["serve", "--write-behind", "-U", "s", "d"]), None);
        assert_eq!(find_in(&["serve", "-U", "on", "d.img"]), None);
        assert_eq!(find_in(&["serve", "--", "--write-behind", "on"]), None);
    }
}
