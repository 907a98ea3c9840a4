//! The same client for synchronous callers (the CLI): owns a small runtime.

use std::sync::Arc;

use super::{BlockStatus, ConnectOptions, Error, ExportInfo, Result, ZeroFlags};
use crate::uri::NbdUri;

pub struct Client {
    rt: tokio::runtime::Runtime,
    inner: Arc<super::Client>,
}

impl Client {
    pub fn connect(uri: &NbdUri, opts: &ConnectOptions) -> Result<Client> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| Error::Connect {
                target: uri.to_string(),
                message: format!("cannot start the I/O runtime: {e}"),
            })?;
        let inner = Arc::new(rt.block_on(super::Client::connect(uri, opts))?);
        Ok(Client { rt, inner })
    }
    pub fn info(&self) -> &ExportInfo {
        self.inner.info()
    }
    pub fn size(&self) -> u64 {
        self.inner.size()
    }
    /// The async client, for use inside [`Client::runtime`].
    pub fn inner(&self) -> &Arc<super::Client> {
        &self.inner
    }
    pub fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.rt
    }
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        // One reply buffer for every chunk, not one per request.
        let max = self.info().max_io().max(4096) as usize;
        let mut v = vec![0u8; buf.len().min(max)];
        let mut done = 0;
        while done < buf.len() {
            let n = (buf.len() - done).min(max);
            v = self
                .rt
                .block_on(self.inner.read_into(offset + done as u64, v, 0..n))?;
            buf[done..done + n].copy_from_slice(&v[..n]);
            done += n;
        }
        Ok(())
    }
    pub fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let max = self.info().max_io().max(4096) as usize;
        for (i, c) in buf.chunks(max).enumerate() {
            self.rt
                .block_on(self.inner.write(offset + (i * max) as u64, c, fua))?;
        }
        Ok(())
    }
    pub fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.rt.block_on(self.inner.zero(offset, len, flags))
    }
    pub fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.rt.block_on(self.inner.trim(offset, len, fua))
    }
    pub fn flush(&self) -> Result<()> {
        self.rt.block_on(self.inner.flush())
    }
    pub fn block_status(&self, offset: u64, len: u64) -> Result<Vec<BlockStatus>> {
        self.rt.block_on(self.inner.block_status(offset, len))
    }
    /// Descriptors of one of the extra contexts selected when connecting.
    pub fn block_status_context(
        &self,
        name: &str,
        offset: u64,
        len: u64,
    ) -> Result<Vec<BlockStatus>> {
        self.rt
            .block_on(self.inner.block_status_context(name, offset, len))
    }
    pub fn disconnect(&self) -> Result<()> {
        self.rt.block_on(self.inner.disconnect())
    }
}
