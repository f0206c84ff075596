//! Standard Webhooks signatures (SPEC CB-3): `v1,<base64 HMAC-SHA256 of
//! "{webhook-id}.{webhook-timestamp}.{body}">`, one per secret, separated by spaces.

use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The `webhook-signature` value of `body` sent as message `id` at Unix second `timestamp`,
/// signed with each of `keys` (the decoded `whsec_` secrets).
pub(crate) fn signature(keys: &[Vec<u8>], id: &str, timestamp: i64, body: &[u8]) -> String {
    keys.iter()
        .filter_map(|key| {
            let mut mac = Hmac::<Sha256>::new_from_slice(key).ok()?;
            mac.update(id.as_bytes());
            mac.update(b".");
            mac.update(timestamp.to_string().as_bytes());
            mac.update(b".");
            mac.update(body);
            let tag = mac.finalize().into_bytes();
            Some(format!(
                "v1,{}",
                base64::engine::general_purpose::STANDARD.encode(tag)
            ))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of the Standard Webhooks specification's reference libraries
    /// (`standard-webhooks/libraries`, the Python and JavaScript tests).
    #[test]
    fn signs_like_the_reference_libraries_cb3() {
        let key = crate::config::webhook_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = br#"{"test": 2432232314}"#;
        let sig = signature(
            std::slice::from_ref(&key),
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            body,
        );
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        let two = signature(
            &[key.clone(), key],
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            body,
        );
        assert_eq!(two.split(' ').count(), 2);
    }
}
