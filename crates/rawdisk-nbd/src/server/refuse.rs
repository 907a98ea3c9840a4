//! A connection beyond the connection cap still gets an answer a client
//! can show: the greeting, then NBD_REP_ERR_POLICY with the reason to each
//! option until the client aborts or hangs up (spec: the server MAY refuse
//! any option with an error; a client that gets one for GO gives up).
//! First it waits a second for a place, as a client that reconnects at once
//! may be racing the end of its own last connection. The refusal is sent
//! within a second and for a few connections at once; beyond that, or for
//! NBD_OPT_EXPORT_NAME (which has no error reply), the connection is closed.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::{admitted, protocol_error, BoxRead, BoxWrite, Shared};
use crate::proto::*;
use crate::sock::RawSock;

/// Time a connection over the cap waits for a place before it is refused.
const ADMIT_WAIT: Duration = Duration::from_secs(1);
/// Time a refused client gets to hear why.
const REFUSE_WITHIN: Duration = Duration::from_secs(1);
/// Connections over the cap waiting or being answered at once; more are
/// closed silently.
pub(super) const REFUSING_MAX: usize = 16;
/// Options answered before the refusal gives up on the client.
const REFUSED_OPTIONS: usize = 16;

impl Shared {
    /// A connection that found the server full waits, on its own task, up
    /// to `ADMIT_WAIT` for a place and is then served; otherwise it is
    /// told why. A client often reconnects the moment its last connection
    /// closed (a copy, then its check), before the server has let that
    /// one go; qemu-nbd leaves such a client in the listen backlog.
    pub(super) fn wait_or_refuse(
        self: &Arc<Self>,
        tasks: &mut JoinSet<()>,
        rd: BoxRead,
        wr: BoxWrite,
        sink: RawSock,
        peer: String,
        shutdown: watch::Receiver<bool>,
    ) {
        let Ok(waiting) = self.refusing.clone().try_acquire_owned() else {
            self.refused(&peer);
            return;
        };
        let sh = self.clone();
        let mut stopping = shutdown.clone();
        tasks.spawn(async move {
            let place = tokio::select! {
                p = tokio::time::timeout(ADMIT_WAIT, sh.conns.clone().acquire_owned()) => p,
                // Not admitted into a server that is going away: closed.
                _ = stopping.wait_for(|v| *v) => return,
            };
            if let Ok(Ok(place)) = place {
                drop(waiting);
                return admitted(sh, rd, wr, Some(sink), peer, shutdown, place).await;
            }
            sh.refused(&peer);
            let why = format!(
                "too many connections (the server's limit is {}); try again later",
                sh.cfg.max_connections
            );
            let _ = tokio::time::timeout(REFUSE_WITHIN, refusal(rd, wr, why)).await;
            drop(waiting);
        });
    }
}

async fn refusal<R, W>(mut rd: R, mut wr: W, why: String) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut out = Vec::with_capacity(128);
    encode_greeting(&mut out, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    wr.write_all(&out).await?;
    wr.flush().await?;
    let mut flags = [0u8; 4];
    rd.read_exact(&mut flags).await?;
    let mut data = vec![0u8; 4096];
    for _ in 0..REFUSED_OPTIONS {
        let mut hb = [0u8; OPTION_HEADER_LEN];
        rd.read_exact(&mut hb).await?;
        let (h, _) = decode_option_header(&hb).map_err(|e| protocol_error(e.to_string()))?;
        if h.option == OPT_EXPORT_NAME || h.len as usize > data.len() {
            break;
        }
        // Read, so that closing does not reset the connection under the reply.
        rd.read_exact(&mut data[..h.len as usize]).await?;
        out.clear();
        let reply = if h.option == OPT_ABORT {
            OptionReply::Ack
        } else {
            OptionReply::Error {
                reply: REP_ERR_POLICY,
                message: why.clone(),
            }
        };
        reply.encode(h.option, &mut out);
        wr.write_all(&out).await?;
        wr.flush().await?;
        // After the error for GO a client aborts or hangs up; closing first
        // would fail its ABORT and hide the error behind EPIPE.
        if h.option == OPT_ABORT {
            break;
        }
    }
    wr.shutdown().await
}
