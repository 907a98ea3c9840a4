//! `serve --stats`: the server's totals as JSON.

use rawdisk_nbd::server::Totals;

/// `--stats`: the totals as JSON, keys in qemu-img's kebab-case
/// (NBD_CMD_WRITE_ZEROES is "write-zeroes", NBD_EIO "eio").
pub(super) fn stats_json(t: &Totals) -> serde_json::Value {
    use serde_json::{json, Map, Value};
    let key = |name: &str, prefix: &str| {
        name.trim_start_matches(prefix)
            .to_ascii_lowercase()
            .replace('_', "-")
    };
    let requests: Map<String, Value> = t
        .tally
        .commands()
        .map(|(c, n, bytes)| {
            let k = c.map_or("other".into(), |c| key(c.name(), "NBD_CMD_"));
            (k, json!({ "requests": n, "bytes": bytes }))
        })
        .collect();
    let errors: Map<String, Value> = t
        .tally
        .errors()
        .map(|(e, n)| {
            let k = match e {
                0 => "other".into(),
                e => key(rawdisk_nbd::proto::error_name(e), "NBD_"),
            };
            (k, json!(n))
        })
        .collect();
    json!({
        "uptime-seconds": t.uptime.as_secs_f64(),
        "connections": {
            "accepted": t.accepted,
            "negotiated": t.negotiated,
            "open": t.open,
            "refused-at-cap": t.refused_at_cap,
            "closed-in-handshake": t.closed_in_handshake,
            "unknown-export": t.unknown_export,
            "tls-required": t.tls_required,
        },
        "requests": requests,
        "errors": errors,
        "peak-in-flight": t.tally.peak_in_flight,
        "aio-completed": t.tally.aio_completed,
        "unanswered": t
            .unanswered
            .iter()
            .map(|&(id, n)| json!({ "connection": id, "requests": n }))
            .collect::<Vec<_>>(),
    })
}
