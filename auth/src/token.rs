//! Bearer tokens: `gct_` + a 16-hex-digit id + `_` + a 43-character secret
//! (32 random bytes, base64url).
//!
//! Masters keep the id and a SHA-256 hash of the secret, never the secret.
//! A slow password hash (argon2, bcrypt) defends guessable passwords; these
//! secrets are 256 random bits that no one can guess, and every API call
//! checks one, so a fast hash is the right tool (as for GitHub's and
//! Vault's tokens).

use base64::Engine;

use crate::error::AuthError;

const PREFIX: &str = "gct_";
const ID_LEN: usize = 16;
const SECRET_BYTES: usize = 32;
/// base64url without padding of 32 bytes.
const SECRET_LEN: usize = 43;

/// A token, secret included. Its `Debug` shows only the id.
#[derive(Clone, PartialEq, Eq)]
pub struct Token {
    id: String,
    secret: String,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Token({}, secret hidden)", self.id)
    }
}

fn random(bytes: &mut [u8]) -> Result<(), AuthError> {
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), bytes)
        .map_err(|_| AuthError::invalid("token", "the system's random source failed"))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Token {
    /// A new random token.
    pub fn generate() -> Result<Token, AuthError> {
        let mut id = [0u8; ID_LEN / 2];
        random(&mut id)?;
        let mut secret = [0u8; SECRET_BYTES];
        random(&mut secret)?;
        Ok(Token {
            id: hex(&id),
            secret: base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(secret),
        })
    }

    /// Parses a token as given by a user (surrounding white space allowed).
    /// The error never repeats the input, which may be a secret.
    pub fn parse(s: &str) -> Result<Token, AuthError> {
        let bad = |why: &str| AuthError::invalid("token", why);
        let s = s.trim();
        let rest = s
            .strip_prefix(PREFIX)
            .ok_or_else(|| bad("does not start with gct_ (not a gpuctl token)"))?;
        if rest.len() != ID_LEN + 1 + SECRET_LEN || !rest.is_ascii() {
            return Err(bad("has the wrong length (a token is 64 characters)"));
        }
        let (id, secret) = rest.split_at(ID_LEN);
        let secret = secret
            .strip_prefix('_')
            .ok_or_else(|| bad("is malformed (no _ after the id)"))?;
        if !id
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        {
            return Err(bad("is malformed (the id is not lowercase hex)"));
        }
        if !secret
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(bad("is malformed (the secret is not base64url)"));
        }
        Ok(Token {
            id: id.to_string(),
            secret: secret.to_string(),
        })
    }

    /// The public part: names the token in lists, logs and revocations.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The whole token, secret included: shown once to whoever created it.
    pub fn reveal(&self) -> String {
        format!("{PREFIX}{}_{}", self.id, self.secret)
    }

    /// What masters store: hex SHA-256 of the secret.
    pub fn hash(&self) -> String {
        hex(ring::digest::digest(&ring::digest::SHA256, self.secret.as_bytes()).as_ref())
    }

    /// Whether this token's secret hashes to `stored` (compared in constant
    /// time).
    pub fn matches(&self, stored: &str) -> bool {
        let mine = self.hash();
        mine.len() == stored.len()
            && mine
                .bytes()
                .zip(stored.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

/// Whether `id` has the shape of a token id (16 lowercase hex digits).
pub fn is_token_id(id: &str) -> bool {
    id.len() == ID_LEN && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

// A token created with a request id (`CreateTokenRequest.request_id`) can
// be shown again to a resend of that request: masters keep its secret
// sealed with a key derived from the request id, which only the caller
// holds (the state keeps a hash of it, never the id). So the replicated
// state and the Raft log still hold nothing that opens a token without
// something only its creator has.

/// Shortest request id that may seal a token's secret: 128 bits as gpuctl
/// writes them (32 hex digits). A short, guessable id would make the sealed
/// secret as weak as the id.
pub const MIN_SEALING_REQUEST_ID: usize = 32;

fn sealing_key(request_id: &str, token_id: &str) -> Result<ring::aead::LessSafeKey, AuthError> {
    // One key per (request id, token id): a token id is random, so no key
    // ever seals twice and a zero nonce is safe.
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(b"gpuctl token seal v1\0");
    ctx.update(request_id.as_bytes());
    ctx.update(b"\0");
    ctx.update(token_id.as_bytes());
    let key = ring::aead::UnboundKey::new(&ring::aead::CHACHA20_POLY1305, ctx.finish().as_ref())
        .map_err(|_| AuthError::invalid("token", "cannot make a sealing key"))?;
    Ok(ring::aead::LessSafeKey::new(key))
}

/// What masters remember of a request id: hex SHA-256 of it, so that the
/// state does not hold the id that opens a sealed secret.
pub fn request_id_hash(request_id: &str) -> String {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(b"gpuctl request id v1\0");
    ctx.update(request_id.as_bytes());
    hex(ctx.finish().as_ref())
}

impl Token {
    /// The secret sealed with `request_id` (ChaCha20-Poly1305), base64url:
    /// only [`Token::unseal`] with the same request id opens it.
    pub fn seal(&self, request_id: &str) -> Result<String, AuthError> {
        let key = sealing_key(request_id, &self.id)?;
        let mut data = self.secret.as_bytes().to_vec();
        key.seal_in_place_append_tag(
            ring::aead::Nonce::assume_unique_for_key([0u8; 12]),
            ring::aead::Aad::from(self.id.as_bytes()),
            &mut data,
        )
        .map_err(|_| AuthError::invalid("token", "cannot seal the secret"))?;
        Ok(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(data))
    }

    /// The token `id` whose secret `sealed` holds, opened with the request
    /// id it was sealed with. Fails (without saying more) for another
    /// request id, token id or a damaged seal.
    pub fn unseal(id: &str, sealed: &str, request_id: &str) -> Result<Token, AuthError> {
        let bad = || {
            AuthError::invalid(
                "token",
                "the sealed secret does not open with this request id",
            )
        };
        let mut data = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(sealed)
            .map_err(|_| bad())?;
        let key = sealing_key(request_id, id)?;
        let secret = key
            .open_in_place(
                ring::aead::Nonce::assume_unique_for_key([0u8; 12]),
                ring::aead::Aad::from(id.as_bytes()),
                &mut data,
            )
            .map_err(|_| bad())?;
        let secret = std::str::from_utf8(secret).map_err(|_| bad())?;
        Token::parse(&format!("{PREFIX}{id}_{secret}")).map_err(|_| bad())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_round_trips_and_matches_only_its_own_hash() {
        let t = Token::generate().unwrap();
        let s = t.reveal();
        assert_eq!(s.len(), 64);
        let back = Token::parse(&format!("  {s}\n")).unwrap();
        assert_eq!(back, t);
        assert!(back.matches(&t.hash()));
        let other = Token::generate().unwrap();
        assert!(!other.matches(&t.hash()));
        assert_ne!(other.id(), t.id());
        assert!(is_token_id(t.id()));
        assert!(!format!("{t:?}").contains(&s[21..]));
    }

    #[test]
    fn a_sealed_secret_opens_only_with_its_request_id() {
        let t = Token::generate().unwrap();
        let rid = "0123456789abcdef0123456789abcdef";
        let sealed = t.seal(rid).unwrap();
        assert!(!sealed.contains(&t.secret), "the seal hides the secret");
        let back = Token::unseal(t.id(), &sealed, rid).unwrap();
        assert_eq!(back, t);
        assert!(back.matches(&t.hash()));
        // Another request id, another token id, a damaged seal: refused.
        assert!(Token::unseal(t.id(), &sealed, "0123456789abcdef0123456789abcdee").is_err());
        let other = Token::generate().unwrap();
        assert!(Token::unseal(other.id(), &sealed, rid).is_err());
        let mut damaged = sealed.clone().into_bytes();
        damaged[3] = if damaged[3] == b'A' { b'B' } else { b'A' };
        assert!(Token::unseal(t.id(), &String::from_utf8(damaged).unwrap(), rid).is_err());
        assert!(Token::unseal(t.id(), "not base64!", rid).is_err());
        // The same request id seals two tokens under two keys.
        assert_ne!(other.seal(rid).unwrap(), sealed);
        // What masters keep of the id tells nothing of it.
        let h = request_id_hash(rid);
        assert_eq!(h.len(), 64);
        assert!(!h.contains(rid));
        assert_ne!(h, request_id_hash("0123456789abcdef0123456789abcdee"));
    }

    #[test]
    fn malformed_tokens_are_refused_without_echoing_them() {
        let good = Token::generate().unwrap().reveal();
        let cases = [
            String::new(),
            "Bearer x".to_string(),
            good.replacen("gct_", "gcx_", 1),
            format!("{good}x"),
            good[..63].to_string(),
            format!("gct_{}_{}", "G".repeat(16), &good[21..]),
            format!("{}!{}", &good[..20], &good[21..]),
            format!("{}é{}", &good[..62], ""),
        ];
        for c in cases {
            let e = Token::parse(&c).unwrap_err().to_string();
            assert!(e.starts_with("token:"), "{c:?}: {e}");
            if c.len() > 8 {
                assert!(!e.contains(&c[8..]), "echoed: {e}");
            }
        }
    }
}
