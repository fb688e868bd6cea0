//! Errors of credential handling: key material and TLS setup.

/// Errors of this crate: bad or missing key material, or a failed TLS setup.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{what}: {msg}")]
    Invalid { what: String, msg: String },
    #[error("certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
}
