//! The cluster CA and the certificates it signs.
//!
//! Every certificate names its holder as `gpuctl://ROLE/NAME` (a URI SAN)
//! and carries `ROLE.gpuctl` (a DNS SAN) plus any addresses asked for. Only
//! the CA decides what goes into a certificate: a signing request
//! contributes its public key and nothing else.

use std::net::IpAddr;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use rustls::pki_types::CertificateDer;
use time::OffsetDateTime;

use crate::error::AuthError;
use crate::{read, CertRole};

/// How far back a new certificate's validity starts: a little clock skew
/// between hosts must not make a fresh certificate "not yet valid".
const BACKDATE: Duration = Duration::from_secs(300);

/// Longest name a certificate may carry (an agent id, a client name).
pub const MAX_NAME_LEN: usize = 128;

/// Who a certificate says its holder is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub role: CertRole,
    pub name: String,
    /// End of validity, in milliseconds since the Unix epoch.
    pub not_after_ms: u64,
    pub not_before_ms: u64,
}

/// A certificate signed by the CA.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert_pem: String,
    /// The new private key, when the CA made the key pair (never when it
    /// signed a request: that key stays with its owner).
    pub key_pem: Option<String>,
    pub not_after_ms: u64,
}

/// The cluster's certificate authority: its certificate and private key.
pub struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
    cert_pem: String,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

/// Checks a certificate name: 1 to [`MAX_NAME_LEN`] of `[A-Za-z0-9._-]`,
/// so that it reads the same in a URI, a log line and a file name.
pub fn check_name(name: &str) -> Result<(), AuthError> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(AuthError::invalid(
            "name",
            format!("must be 1 to {MAX_NAME_LEN} characters, got {}", name.len()),
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(AuthError::invalid(
            "name",
            format!("{name:?}: character {c:?} is not one of A-Z a-z 0-9 . _ -"),
        ));
    }
    Ok(())
}

fn identity_uri(role: CertRole, name: &str) -> String {
    format!("gpuctl://{}/{name}", role.as_str())
}

fn ia5(s: &str) -> Result<rcgen::Ia5String, AuthError> {
    rcgen::Ia5String::try_from(s.to_string())
        .map_err(|e| AuthError::invalid("subject alternative name", format!("{s:?}: {e}")))
}

fn to_ms(t: OffsetDateTime) -> u64 {
    u64::try_from(t.unix_timestamp()).unwrap_or(0) * 1000
}

fn now() -> OffsetDateTime {
    OffsetDateTime::from(SystemTime::now())
}

/// The parameters of a certificate for `role`/`name`, valid from a little
/// before now for `ttl`.
fn leaf_params(
    role: CertRole,
    name: &str,
    ttl: Duration,
    sans: &[String],
) -> Result<CertificateParams, AuthError> {
    check_name(name)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("{}:{name}", role.as_str()));
    dn.push(DnType::OrganizationName, "gpuctl");
    params.distinguished_name = dn;
    // A tenth of a short lifetime at most, so that renewing after two
    // thirds of it stays after the moment it was issued.
    params.not_before = now() - BACKDATE.min(ttl / 10);
    params.not_after = now() + ttl;
    params.serial_number = Some(random_serial()?);
    let mut names = vec![
        SanType::URI(ia5(&identity_uri(role, name))?),
        SanType::DnsName(ia5(role.server_name())?),
    ];
    for s in sans {
        let s = s.trim();
        if s.is_empty() {
            continue;
        }
        names.push(match s.parse::<IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(ia5(s)?),
        });
    }
    params.subject_alt_names = names;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    // Masters and agents are servers and clients both; a client never
    // serves, but the purpose alone grants nothing: its role does.
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    Ok(params)
}

fn random_serial() -> Result<SerialNumber, AuthError> {
    let mut bytes = [0u8; 16];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .map_err(|_| AuthError::invalid("serial number", "the system's random source failed"))?;
    // Positive: the high bit clear.
    bytes[0] &= 0x7f;
    Ok(SerialNumber::from_slice(&bytes))
}

impl Ca {
    /// A new CA with a fresh key, valid for `ttl`.
    pub fn generate(cluster: &str, ttl: Duration) -> Result<Ca, AuthError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, format!("gpuctl CA {cluster}"));
        dn.push(DnType::OrganizationName, "gpuctl");
        params.distinguished_name = dn;
        params.not_before = now() - BACKDATE;
        params.not_after = now() + ttl;
        params.serial_number = Some(random_serial()?);
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key)?;
        let cert_pem = cert.pem();
        Ok(Ca {
            cert,
            key,
            cert_pem,
        })
    }

    /// A CA from its certificate and key in PEM.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Ca, AuthError> {
        let key = KeyPair::from_pem(key_pem)
            .map_err(|e| AuthError::invalid("CA key", format!("not a PEM private key: {e}")))?;
        let params = CertificateParams::from_ca_cert_pem(cert_pem)
            .map_err(|e| AuthError::invalid("CA certificate", e))?;
        // Only the name, key identifier and usages of this copy are used
        // (as the issuer of what we sign); the file's PEM is what we hand out.
        let cert = params.self_signed(&key)?;
        let cert_pem = first_pem_block(cert_pem)?;
        Ok(Ca {
            cert,
            key,
            cert_pem,
        })
    }

    /// A CA from its certificate and key files.
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<Ca, AuthError> {
        let cert = String::from_utf8_lossy(&read(cert_path)?).into_owned();
        let key = String::from_utf8_lossy(&read(key_path)?).into_owned();
        Ca::from_pem(&cert, &key).map_err(|e| match e {
            AuthError::Invalid { what, msg } => AuthError::Invalid {
                what: format!("{what} ({} / {})", cert_path.display(), key_path.display()),
                msg,
            },
            e => e,
        })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
    }

    /// A certificate and a new key for `role`/`name`, valid for `ttl`, also
    /// naming `sans` (host names or IP addresses clients may dial).
    pub fn issue(
        &self,
        role: CertRole,
        name: &str,
        ttl: Duration,
        sans: &[String],
    ) -> Result<Issued, AuthError> {
        let key = KeyPair::generate()?;
        let params = leaf_params(role, name, ttl, sans)?;
        let not_after_ms = to_ms(params.not_after);
        let cert = params.signed_by(&key, &self.cert, &self.key)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: Some(key.serialize_pem()),
            not_after_ms,
        })
    }

    /// Signs a certificate signing request as `role`/`name`: of the request
    /// only the public key is used.
    pub fn sign_request(
        &self,
        csr_pem: &str,
        role: CertRole,
        name: &str,
        ttl: Duration,
        sans: &[String],
    ) -> Result<Issued, AuthError> {
        let csr = CertificateSigningRequestParams::from_pem(csr_pem)
            .map_err(|e| AuthError::invalid("csr", format!("not a PEM signing request: {e}")))?;
        let params = leaf_params(role, name, ttl, sans)?;
        let not_after_ms = to_ms(params.not_after);
        let cert = params.signed_by(&csr.public_key, &self.cert, &self.key)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: None,
            not_after_ms,
        })
    }
}

/// A new key pair and a signing request for it, in PEM: `(csr, key)`. The
/// request names nothing: the CA decides the identity.
pub fn signing_request() -> Result<(String, String), AuthError> {
    let key = KeyPair::generate()?;
    let csr = CertificateParams::default().serialize_request(&key)?;
    Ok((csr.pem()?, key.serialize_pem()))
}

/// A new key pair, as PEM, for [`signing_request_for`]: kept by its owner
/// so that a request sent again (its answer lost) is the same request.
pub fn new_key_pem() -> Result<String, AuthError> {
    Ok(KeyPair::generate()?.serialize_pem())
}

/// A certificate signing request for the key pair `key_pem`.
pub fn signing_request_for(key_pem: &str) -> Result<String, AuthError> {
    let key = KeyPair::from_pem(key_pem)?;
    Ok(CertificateParams::default()
        .serialize_request(&key)?
        .pem()?)
}

/// Hex SHA-256 of the public key (its SubjectPublicKeyInfo) that the
/// signing request `csr_pem` asks a certificate for: what names one
/// request, whatever else its text holds.
pub fn csr_key_hash(csr_pem: &str) -> Result<String, AuthError> {
    use x509_parser::prelude::FromDer;
    let bad = |msg: String| AuthError::invalid("signing request", &msg);
    let (_, pem) = x509_parser::pem::parse_x509_pem(csr_pem.as_bytes())
        .map_err(|e| bad(format!("not PEM: {e}")))?;
    let (_, csr) =
        x509_parser::certification_request::X509CertificationRequest::from_der(&pem.contents)
            .map_err(|e| bad(format!("not a signing request: {e}")))?;
    let spki = csr.certification_request_info.subject_pki.raw;
    let digest = ring::digest::digest(&ring::digest::SHA256, spki);
    Ok(digest.as_ref().iter().map(|b| format!("{b:02x}")).collect())
}

/// The first PEM block of `pem`, re-encoded (drops comments around it).
fn first_pem_block(pem: &str) -> Result<String, AuthError> {
    let certs = certs_from_pem(pem.as_bytes(), "CA certificate")?;
    let der = certs
        .first()
        .ok_or_else(|| AuthError::invalid("CA certificate", "no certificate in the PEM text"))?;
    Ok(pem_encode("CERTIFICATE", der))
}

fn pem_encode(label: &str, der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(chunk));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// Every certificate in a PEM text.
pub fn certs_from_pem(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>, AuthError> {
    use rustls::pki_types::pem::PemObject;
    let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(pem).collect();
    let certs = certs.map_err(|e| AuthError::invalid(what, format!("bad PEM: {e:?}")))?;
    if certs.is_empty() {
        return Err(AuthError::invalid(what, "no certificate in the PEM text"));
    }
    Ok(certs)
}

/// Who a certificate (DER) names, from its `gpuctl://ROLE/NAME` SAN.
pub fn identity_of(der: &[u8]) -> Result<Identity, AuthError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| AuthError::invalid("certificate", e))?;
    let validity = cert.validity();
    let not_after_ms = u64::try_from(validity.not_after.timestamp())
        .unwrap_or(0)
        .saturating_mul(1000);
    let not_before_ms = u64::try_from(validity.not_before.timestamp())
        .unwrap_or(0)
        .saturating_mul(1000);
    let san = cert
        .subject_alternative_name()
        .map_err(|e| AuthError::invalid("certificate", e))?
        .ok_or_else(|| AuthError::invalid("certificate", "no subject alternative names"))?;
    for name in &san.value.general_names {
        if let x509_parser::extensions::GeneralName::URI(uri) = name {
            if let Some(rest) = uri.strip_prefix("gpuctl://") {
                let (role, name) = rest
                    .split_once('/')
                    .ok_or_else(|| AuthError::invalid("certificate", format!("bad URI {uri}")))?;
                let role = CertRole::parse(role).ok_or_else(|| {
                    AuthError::invalid("certificate", format!("unknown role in {uri}"))
                })?;
                check_name(name)?;
                return Ok(Identity {
                    role,
                    name: name.to_string(),
                    not_after_ms,
                    not_before_ms,
                });
            }
        }
    }
    Err(AuthError::invalid(
        "certificate",
        "names no gpuctl identity (gpuctl://ROLE/NAME)",
    ))
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    /// Two requests for one kept key are one request by their key's hash;
    /// another key's is another; text that is no request is refused.
    #[test]
    fn a_request_is_named_by_its_key() {
        let key = new_key_pem().unwrap();
        let a = signing_request_for(&key).unwrap();
        let b = signing_request_for(&key).unwrap();
        let h = csr_key_hash(&a).unwrap();
        assert_eq!(h.len(), 64);
        assert_eq!(csr_key_hash(&b).unwrap(), h);
        let (other, _) = signing_request().unwrap();
        assert_ne!(csr_key_hash(&other).unwrap(), h);
        assert!(csr_key_hash("not pem").is_err());
        let cert_not_csr = Ca::generate("t", DAY).unwrap().cert_pem().to_string();
        assert!(csr_key_hash(&cert_not_csr).is_err());
    }

    fn der(pem: &str) -> Vec<u8> {
        certs_from_pem(pem.as_bytes(), "test").unwrap()[0].to_vec()
    }

    #[test]
    fn an_issued_certificate_names_its_role_and_holder() {
        let ca = Ca::generate("test", DAY).unwrap();
        let issued = ca
            .issue(CertRole::Agent, "gpu-node-7", DAY, &["10.0.0.7".into()])
            .unwrap();
        let id = identity_of(&der(&issued.cert_pem)).unwrap();
        assert_eq!(id.role, CertRole::Agent);
        assert_eq!(id.name, "gpu-node-7");
        let now = now_ms();
        assert!(id.not_after_ms > now + DAY.as_millis() as u64 - 60_000);
        assert!(id.not_before_ms < now);
        assert!(issued.key_pem.is_some());
    }

    #[test]
    fn a_signed_request_gets_the_identity_the_ca_chose() {
        let ca = Ca::generate("test", DAY).unwrap();
        let (csr, _key) = signing_request().unwrap();
        let issued = ca
            .sign_request(&csr, CertRole::Agent, "a1", DAY, &[])
            .unwrap();
        assert!(issued.key_pem.is_none());
        let id = identity_of(&der(&issued.cert_pem)).unwrap();
        assert_eq!((id.role, id.name.as_str()), (CertRole::Agent, "a1"));
    }

    #[test]
    fn a_ca_reloaded_from_pem_signs_what_the_original_verifies() {
        let ca = Ca::generate("test", DAY).unwrap();
        let again = Ca::from_pem(ca.cert_pem(), &ca.key_pem()).unwrap();
        assert_eq!(again.cert_pem(), ca.cert_pem());
        let issued = again.issue(CertRole::Client, "alice", DAY, &[]).unwrap();
        // Verified with the original CA certificate by webpki itself.
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der(ca.cert_pem()).into()).unwrap();
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.into(),
            rustls::crypto::ring::default_provider().into(),
        )
        .build()
        .unwrap();
        let leaf = CertificateDer::from(der(&issued.cert_pem));
        verifier
            .verify_client_cert(&leaf, &[], rustls::pki_types::UnixTime::now())
            .unwrap();
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("node-1.rack_2").is_ok());
        for bad in ["", "a/b", "a b", "ü", &"x".repeat(MAX_NAME_LEN + 1)] {
            let e = check_name(bad).unwrap_err().to_string();
            assert!(e.starts_with("name:"), "{bad:?}: {e}");
        }
        let ca = Ca::generate("test", DAY).unwrap();
        assert!(ca.issue(CertRole::Agent, "../x", DAY, &[]).is_err());
    }

    #[test]
    fn garbage_is_refused_with_a_reason() {
        assert!(Ca::from_pem("not pem", "not pem").is_err());
        assert!(identity_of(b"\x30\x03\x02\x01\x00").is_err());
        let ca = Ca::generate("test", DAY).unwrap();
        let e = ca
            .sign_request("junk", CertRole::Agent, "a", DAY, &[])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("csr:"), "{e}");
        // A CA certificate names no gpuctl identity.
        let e = identity_of(&der(ca.cert_pem())).unwrap_err().to_string();
        assert!(
            e.contains("subject alternative names") || e.contains("identity"),
            "{e}"
        );
    }
}
