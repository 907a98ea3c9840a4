//! The reply writer of one connection: a task that owns the socket's write
//! half and sends the replies of blocking jobs in completion order, and the
//! one way any reply (the reader's own too) goes out.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::mpsc;

use super::Permits;
use crate::server::command::Encoded;
use crate::server::limits::Counters;
use crate::server::Shared;
use crate::sock::RawSock;

/// A finished reply on its way to the writer.
pub(super) struct Out {
    pub(super) reply: Encoded,
    pub(super) _permits: Permits,
}

/// Sends the replies of blocking jobs as they arrive, several per flush when
/// several are ready, until every sender is gone.
pub(super) async fn writer<W: AsyncWrite + Unpin>(
    wr: Arc<tokio::sync::Mutex<BufWriter<W>>>,
    mut rx: mpsc::UnboundedReceiver<Box<Out>>,
    sh: Arc<Shared>,
    sink: Option<RawSock>,
    counters: Arc<Counters>,
) -> io::Result<()> {
    while let Some(out) = rx.recv().await {
        let mut wr = wr.lock().await;
        within(sh.cfg.idle_timeout, async {
            put_reply(&sh, &mut wr, sink.as_ref(), &counters, out.reply).await?;
            // Coalesce whatever else is ready into the same flush.
            while let Ok(out) = rx.try_recv() {
                put_reply(&sh, &mut wr, sink.as_ref(), &counters, out.reply).await?;
            }
            wr.flush().await
        })
        .await?;
    }
    wr.lock().await.shutdown().await
}

/// Replies that cannot be sent within the idle timeout mean a client that
/// stopped reading: the connection ends (TimedOut), which frees what its
/// replies hold and its place under the connection cap.
pub(super) async fn within(
    limit: Option<Duration>,
    f: impl Future<Output = io::Result<()>>,
) -> io::Result<()> {
    let Some(t) = limit else {
        return f.await;
    };
    match tokio::time::timeout(t, f).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the client read no reply for {t:?}"),
        )),
    }
}

/// Queues one reply on the buffered writer; a spliced read's header is
/// flushed and its data spliced from the pipes to the socket behind it.
pub(super) async fn put_reply<W: AsyncWrite + Unpin>(
    sh: &Shared,
    wr: &mut BufWriter<W>,
    sink: Option<&RawSock>,
    counters: &Counters,
    reply: Encoded,
) -> io::Result<()> {
    if reply.err != 0 {
        counters.error(reply.err);
    }
    wr.write_all(&reply.buf[reply.start..reply.end]).await?;
    sh.pool.put(reply.buf);
    if !reply.spliced.is_empty() {
        let sink = sink.expect("spliced replies only on sessions with a splice sink");
        wr.flush().await?;
        for sp in reply.spliced {
            sink.send_from(&sp.pipe, sp.len).await?;
            // Only an emptied pipe goes back: an error above drops the rest
            // with whatever they still hold.
            sh.pipes.put(sp.pipe);
        }
    }
    counters.answered();
    Ok(())
}
