//! Listing a server's exports (NBD_OPT_LIST, then NBD_OPT_INFO for each),
//! for `info --list`; nothing is opened for I/O.

use std::time::Duration;

use super::{client_tls, conn, handshake, stream, Error, ExportInfo, Result};
use crate::tls::ClientTls;
use crate::uri::NbdUri;

/// One export a server lists (NBD_OPT_LIST), as NBD_OPT_INFO describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedExport {
    pub name: String,
    /// The description NBD_OPT_LIST or NBD_INFO_DESCRIPTION gave, if any.
    pub description: Option<String>,
    /// Size, flags and block sizes; None when the server would not describe
    /// the export (no NBD_OPT_INFO, or an export it lists but refuses).
    pub info: Option<ExportInfo>,
}

/// The exports the server at `uri` offers, with their sizes, as `nbdinfo
/// --list` and `qemu-nbd -L` show them. The URI's export name is not used;
/// TLS is negotiated first for an `nbds://` URI. Nothing is opened for I/O.
pub async fn list_exports(uri: &NbdUri, timeout: Duration) -> Result<Vec<ListedExport>> {
    let target = uri.to_string();
    match tokio::time::timeout(timeout, list_on(uri, &target)).await {
        Ok(r) => r,
        Err(_) => Err(Error::Connect {
            target,
            message: format!("timed out after {timeout:?}"),
        }),
    }
}

/// NBD_OPT_INFO requests per connection: servers cap the options of one
/// handshake (rawdisk at 64, older nbdkit at 32), so a long list is
/// described over several connections.
const INFOS_PER_CONNECTION: usize = 16;

async fn list_on(uri: &NbdUri, target: &str) -> Result<Vec<ListedExport>> {
    let hs_err = |cause| Error::Handshake {
        target: target.to_string(),
        cause,
    };
    let tls = client_tls(uri, target)?;
    let (mut r, mut w) = negotiate(uri, target, tls.as_ref()).await?;
    let names = handshake::list_exports(&mut r, &mut w)
        .await
        .map_err(hs_err)?;
    let mut out = Vec::with_capacity(names.len());
    for (i, (name, description)) in names.into_iter().enumerate() {
        if i > 0 && i % INFOS_PER_CONNECTION == 0 {
            handshake::abort(&mut w).await;
            (r, w) = negotiate(uri, target, tls.as_ref()).await?;
        }
        let info = handshake::export_info(&mut r, &mut w, &name)
            .await
            .map_err(hs_err)?;
        let description = (!description.is_empty())
            .then_some(description)
            .or_else(|| info.as_ref().and_then(|i| i.description.clone()));
        out.push(ListedExport {
            name,
            description,
            info,
        });
    }
    handshake::abort(&mut w).await;
    Ok(out)
}

/// A connection in the option phase, for options only.
async fn negotiate(
    uri: &NbdUri,
    target: &str,
    tls: Option<&ClientTls>,
) -> Result<(stream::Reader, stream::Writer)> {
    let (r, w, _, _) = conn::dial(uri, target, tls).await?;
    Ok((r, w))
}
