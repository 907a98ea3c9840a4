//! A connection beyond the connection cap still gets an answer a client
//! can show: the greeting, then NBD_REP_ERR_POLICY with the reason to each
//! option until the client aborts or hangs up (spec: the server MAY refuse
//! any option with an error; a client that gets one for GO gives up).
//! Within a second and for a few connections at once; beyond that, or for
//! NBD_OPT_EXPORT_NAME (which has no error reply), the connection is closed.

use std::io;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{protocol_error, Shared};
use crate::proto::*;

/// Time a refused client gets to hear why.
const REFUSE_WITHIN: Duration = Duration::from_secs(1);
/// Refused connections answered at once; more are closed silently.
pub(super) const REFUSING_MAX: usize = 16;
/// Options answered before the refusal gives up on the client.
const REFUSED_OPTIONS: usize = 16;

impl Shared {
    /// Answers a connection there is no room for, on its own task.
    pub(super) fn refuse<R, W>(&self, rd: R, wr: W)
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let Ok(permit) = self.refusing.clone().try_acquire_owned() else {
            return;
        };
        let why = format!(
            "too many connections (the server's limit is {}); try again later",
            self.cfg.max_connections
        );
        tokio::spawn(async move {
            let _ = tokio::time::timeout(REFUSE_WITHIN, refusal(rd, wr, why)).await;
            drop(permit);
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
