//! Who is calling: the identity in the TLS client certificate of the
//! connection a request arrived on.

use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::error::AuthError;
use crate::pki::{identity_of, Identity};

/// The identity of the client certificate the connection presented: none
/// when it presented none (or the connection is not TLS), an error when
/// the certificate names no gpuctl identity. The chain was verified
/// against the trusted CAs during the handshake.
pub fn identity(extensions: &http::Extensions) -> Option<Result<Identity, AuthError>> {
    let info = extensions.get::<TlsConnectInfo<TcpConnectInfo>>()?;
    let certs = info.peer_certs()?;
    let leaf = certs.first()?;
    Some(identity_of(leaf))
}
