//! The two halves of a client connection's byte stream, plaintext or TLS,
//! and reading from it in the handshake. Both the connection (`conn`) and
//! the option negotiation (`handshake`) use them; neither owns them, so
//! neither imports the other for them.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, BufReader};

use super::HandshakeError;

pub(super) type Reader = BufReader<Box<dyn AsyncRead + Send + Unpin>>;
pub(super) type Writer = Box<dyn AsyncWrite + Send + Unpin>;

/// Fills `buf`; a stream that ends or fails first is a dropped connection.
pub(super) async fn read_exact(
    r: &mut Reader,
    buf: &mut [u8],
) -> std::result::Result<(), HandshakeError> {
    r.read_exact(buf)
        .await
        .map(|_| ())
        .map_err(|e| HandshakeError::Dropped {
            kind: e.kind(),
            message: if e.kind() == std::io::ErrorKind::UnexpectedEof {
                "the server closed the connection".to_string()
            } else {
                format!("reading from the server: {e}")
            },
        })
}
