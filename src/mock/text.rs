//! Deterministic content: the reply text, its stream pieces, token counts, embeddings, base64.
//!
//! Everything here is a pure function of the request body, so the same body always gets the same
//! reply and a different body (almost surely) a different one. The seed ignores the top-level
//! `stream` and `stream_options` keys, so a streamed call and a non-streamed call of the same
//! request produce the same text (the stream pieces concatenate to the non-stream text).

use serde_json::Value;

/// Words the reply is made of; 64 of them, so 8 words give 2^48 distinct replies.
const VOCAB: [&str; 64] = [
    "amber", "basil", "cedar", "delta", "ember", "fjord", "grove", "harbor", "iris", "juniper",
    "kelp", "lumen", "maple", "nectar", "onyx", "pebble", "quartz", "raven", "sage", "tidal",
    "umber", "violet", "willow", "xenon", "yarrow", "zephyr", "anchor", "bramble", "cobalt",
    "dune", "estuary", "flint", "granite", "heron", "inlet", "jasper", "kestrel", "lichen",
    "meadow", "nimbus", "orchid", "prairie", "quill", "reef", "summit", "thistle", "upland",
    "vale", "wren", "yew", "zinnia", "alder", "birch", "coral", "drift", "egret", "fern", "gale",
    "hazel", "ivy", "jade", "knoll", "lotus", "moss",
];

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// What the reply derives from: a hash of the request and a rough prompt size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seed {
    /// FNV-1a over a walk of the body (object keys in map order, `stream*` keys skipped).
    pub hash: u64,
    /// About one token per four bytes of string content, at least 1.
    pub prompt_tokens: u64,
}

/// Seed of a parsed request body. Top-level `stream` and `stream_options` are left out so that
/// stream and non-stream calls of one request share their text.
pub(crate) fn seed_of(body: &Value) -> Seed {
    let mut hash = FNV_OFFSET;
    let mut string_bytes = 0u64;
    match body {
        Value::Object(map) => {
            fnv(&mut hash, b"{");
            for (k, v) in map {
                if k == "stream" || k == "stream_options" {
                    continue;
                }
                fnv(&mut hash, k.as_bytes());
                fnv(&mut hash, b":");
                walk(v, &mut hash, &mut string_bytes);
            }
        }
        other => walk(other, &mut hash, &mut string_bytes),
    }
    Seed {
        hash,
        prompt_tokens: 1 + string_bytes / 4,
    }
}

/// Hash of a byte string on its own (embedding inputs).
pub(crate) fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut h = FNV_OFFSET;
    fnv(&mut h, bytes);
    h
}

fn fnv(h: &mut u64, bytes: &[u8]) {
    for b in bytes {
        *h ^= u64::from(*b);
        *h = h.wrapping_mul(FNV_PRIME);
    }
}

fn walk(v: &Value, h: &mut u64, string_bytes: &mut u64) {
    match v {
        Value::Null => fnv(h, b"n"),
        Value::Bool(true) => fnv(h, b"t"),
        Value::Bool(false) => fnv(h, b"f"),
        Value::Number(n) => {
            fnv(h, b"#");
            fnv(h, n.to_string().as_bytes());
        }
        Value::String(s) => {
            fnv(h, b"\"");
            fnv(h, s.as_bytes());
            fnv(h, b"\"");
            *string_bytes += s.len() as u64;
        }
        Value::Array(items) => {
            fnv(h, b"[");
            for item in items {
                walk(item, h, string_bytes);
                fnv(h, b",");
            }
            fnv(h, b"]");
        }
        Value::Object(map) => {
            fnv(h, b"{");
            for (k, item) in map {
                fnv(h, k.as_bytes());
                fnv(h, b":");
                walk(item, h, string_bytes);
                fnv(h, b",");
            }
            fnv(h, b"}");
        }
    }
}

/// SplitMix64 finaliser: spreads a counter into well-mixed bits.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn word(seed: u64, i: u64) -> &'static str {
    // `VOCAB.len()` is 64, so the cast cannot truncate.
    VOCAB[(mix(seed ^ mix(i)) % VOCAB.len() as u64) as usize]
}

/// The reply split into `chunks` pieces: `"mock reply to <model>: w1"`, `" w2"`, ... `" wN"`.
/// Their concatenation is the non-stream text; zero chunks give the empty text.
pub(crate) fn pieces(model: &str, seed: u64, chunks: u32) -> Vec<String> {
    (0..u64::from(chunks))
        .map(|i| {
            let w = word(seed, i);
            if i == 0 {
                format!("mock reply to {model}: {w}")
            } else {
                format!(" {w}")
            }
        })
        .collect()
}

/// Appends more deterministic words until `text` is at least `min_bytes` long.
pub(crate) fn pad_to(text: &mut String, min_bytes: usize, seed: u64) {
    if text.len() >= min_bytes {
        return;
    }
    text.reserve(min_bytes - text.len() + 16);
    let mut i = u64::MAX / 2;
    while text.len() < min_bytes {
        text.push(' ');
        text.push_str(word(seed, i));
        i += 1;
    }
}

/// A `dims`-long embedding derived from `input_hash`. Every value is `k/128 - 1` for an integer
/// `k` in 0..256, so it is exact in f32, f64 and JSON alike.
pub(crate) fn embedding(input_hash: u64, dims: usize) -> Vec<f32> {
    (0..dims as u64)
        .map(|j| {
            let k = (mix(input_hash ^ mix(j)) & 0xff) as u8;
            f32::from(k) / 128.0 - 1.0
        })
        .collect()
}

/// Standard base64 (RFC 4648 §4, with `=` padding) of little-endian f32s, the form OpenAI uses
/// for `encoding_format: "base64"`.
pub(crate) fn base64_f32_le(values: &[f32]) -> String {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    base64(&bytes)
}

/// Standard base64 with padding.
pub(crate) fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for group in bytes.chunks(3) {
        let b0 = group[0];
        let b1 = group.get(1).copied().unwrap_or(0);
        let b2 = group.get(2).copied().unwrap_or(0);
        let n = (u32::from(b0) << 16) | (u32::from(b1) << 8) | u32::from(b2);
        out.push(char::from(ALPHABET[(n >> 18) as usize & 63]));
        out.push(char::from(ALPHABET[(n >> 12) as usize & 63]));
        if group.len() > 1 {
            out.push(char::from(ALPHABET[(n >> 6) as usize & 63]));
        } else {
            out.push('=');
        }
        if group.len() > 2 {
            out.push(char::from(ALPHABET[n as usize & 63]));
        } else {
            out.push('=');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (input, want) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(input.as_bytes()), want);
        }
    }

    #[test]
    fn seed_ignores_stream_flags_but_not_content() {
        let a = seed_of(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}));
        let b = seed_of(
            &json!({"model": "m", "stream": true, "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "hi"}]}),
        );
        let c = seed_of(&json!({"model": "m", "messages": [{"role": "user", "content": "ho"}]}));
        assert_eq!(a, b);
        assert_ne!(a.hash, c.hash);
    }

    #[test]
    fn pieces_concatenate_to_the_reply_and_padding_reaches_the_minimum() {
        let p = pieces("gpt", 42, 3);
        assert_eq!(p.len(), 3);
        assert!(p[0].starts_with("mock reply to gpt: "));
        assert!(p[1].starts_with(' ') && p[2].starts_with(' '));
        assert!(pieces("gpt", 42, 0).is_empty());
        let mut t = p.concat();
        pad_to(&mut t, 10_000, 42);
        assert!(t.len() >= 10_000 && t.starts_with(&p.concat()));
    }

    #[test]
    fn embeddings_are_exact_and_in_range() {
        let e = embedding(7, 8);
        assert_eq!(e.len(), 8);
        assert!(e.iter().all(|v| (-1.0..1.0).contains(v)));
        assert_eq!(e, embedding(7, 8));
        assert_ne!(e, embedding(8, 8));
    }
}
