//! Parser fuzzing at scale (issue 18): property tests of the two parsers that read untrusted
//! bytes, the canonical JSON parser (`holdfast::canonical`, SPEC ID-1, ID-2, IN-2) and the SSE
//! parser (`holdfast::sse`, LC-7, IN-2), each against an independent oracle.
//!
//! The unit tests in `src/canonical.rs` and `src/sse.rs` pin the parsers' own rules on small,
//! shallow inputs. These go further: documents up to and past the depth limit, objects wide
//! enough for the full sort, every top-level kind, duplicate keys spelled differently, mutated
//! and token-soup documents judged by `serde_json`, and event streams judged by a second,
//! line-at-a-time reading of the WHATWG rules.
//!
//! Case count: `PROPTEST_CASES` (per property), else [`DEFAULT_CASES`]. The normal suite runs
//! the default; the long form (docs/reliability.md, "Parser fuzzing") is
//! `PROPTEST_CASES=100000 cargo test --release --test parsers`.

#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

use std::collections::HashSet;
use std::fmt;

use holdfast::canonical::{CanonError, MAX_DEPTH, canonicalize};
use holdfast::sse::{self, Finish, SseError, SseEvent, SseParser};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, FileFailurePersistence};
use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// Cases per property when `PROPTEST_CASES` is not set: the whole file stays under 30 s in a
/// debug build on a 2-core machine (docs/reliability.md).
const DEFAULT_CASES: u32 = 4_000;

/// The case count: `PROPTEST_CASES`, else [`DEFAULT_CASES`]. (proptest's own default reads the
/// same variable but falls back to 256.)
fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_CASES);
    ProptestConfig {
        cases,
        // A failing case is saved next to this file (tests/parsers.proptest-regressions) and
        // replayed first on the next run.
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..ProptestConfig::default()
    }
}

// =============================================================================================
// Canonical JSON
// =============================================================================================

/// A generated JSON value. Object members are kept in generation order; keys are distinct
/// unless a test puts a duplicate in on purpose.
#[derive(Debug, Clone)]
enum J {
    Null,
    Bool(bool),
    Num(String),
    Str(String),
    Arr(Vec<J>),
    Obj(Vec<(String, J)>),
}

/// Characters that matter to the parser: ASCII, the escaped ones, controls, 2-, 3- and 4-byte
/// UTF-8, U+E000..U+FFFF (which sorts after the astral planes in UTF-16 order, ID-1), and the
/// JavaScript line separators.
fn any_char() -> impl Strategy<Value = char> {
    prop_oneof![
        8 => proptest::char::range('a', 'e'),
        2 => proptest::char::range(' ', '~'),
        1 => proptest::char::range('\u{0}', '\u{1f}'),
        1 => proptest::sample::select(vec!['"', '\\', '/', '\u{7f}', '\u{2028}', '\u{2029}']),
        1 => proptest::char::range('\u{80}', '\u{7ff}'),
        1 => proptest::char::range('\u{800}', '\u{d7ff}'),
        1 => proptest::char::range('\u{e000}', '\u{ffff}'),
        1 => proptest::char::range('\u{10000}', '\u{10ffff}'),
    ]
}

fn any_string() -> impl Strategy<Value = String> {
    proptest::collection::vec(any_char(), 0..10).prop_map(|v| v.into_iter().collect())
}

/// Keys from a small alphabet, so that objects hold keys sharing prefixes and keys whose UTF-8
/// and UTF-16 orders differ.
fn any_key() -> impl Strategy<Value = String> {
    let c = proptest::sample::select(vec![
        'a', 'b', 'B', '_', 'é', '\u{e000}', '😀', '"', '\u{1}',
    ]);
    proptest::collection::vec(c, 0..4).prop_map(|v| v.into_iter().collect())
}

/// Every spelling of a JSON number: long mantissas and fractions, exponents with and without
/// sign in either case, and exponents far past f64's range (serde_json refuses those; the
/// canonical form copies them, ID-1).
fn any_number() -> impl Strategy<Value = String> {
    proptest::string::string_regex(r"-?(0|[1-9][0-9]{0,24})(\.[0-9]{1,20})?([eE][+-]?[0-9]{1,4})?")
        .unwrap()
}

/// An object of up to `max` members with distinct keys (the first of equal keys is kept).
fn any_object(inner: impl Strategy<Value = J>, max: usize) -> impl Strategy<Value = J> {
    proptest::collection::vec((any_key(), inner), 0..max).prop_map(|members| {
        let mut seen = HashSet::new();
        J::Obj(
            members
                .into_iter()
                .filter(|(k, _)| seen.insert(k.clone()))
                .collect(),
        )
    })
}

/// A JSON value of any kind, up to 6 levels, objects up to 24 members (past the parser's
/// insertion-sort size of 16, so both sorts run).
fn any_value() -> impl Strategy<Value = J> {
    let leaf = prop_oneof![
        Just(J::Null),
        any::<bool>().prop_map(J::Bool),
        any_number().prop_map(J::Num),
        any_string().prop_map(J::Str),
    ];
    leaf.prop_recursive(6, 96, 24, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(J::Arr),
            any_object(inner, 24),
        ]
    })
}

/// Wraps `j` in `levels` containers, arrays or one-member objects as `shape`'s bits say.
fn wrap(mut j: J, levels: usize, shape: u64) -> J {
    for level in 0..levels {
        j = if shape.rotate_left(level as u32) & 1 == 0 {
            J::Arr(vec![j])
        } else {
            J::Obj(vec![("k".into(), j)])
        };
    }
    j
}

/// A document: mostly an object (what a request body is), sometimes any other top level;
/// sometimes nested to around [`MAX_DEPTH`] (ID-2's limit), on both sides of it.
fn any_document() -> impl Strategy<Value = J> {
    let deep = prop_oneof![
        6 => Just(0usize),
        1 => 1usize..12,
        2 => (MAX_DEPTH - 8)..(MAX_DEPTH + 8),
    ];
    (any_value(), deep, any::<u64>(), 0u8..8).prop_map(|(j, levels, shape, top)| {
        let j = wrap(j, levels, shape);
        match (top, j) {
            // Usually: an object at the top, as a request body is.
            (0..=5, J::Obj(m)) => J::Obj(m),
            (0..=5, j) => J::Obj(vec![("v".into(), j)]),
            // Otherwise whatever the value is: array, string, number, literal or object.
            (_, j) => j,
        }
    })
}

/// Container depth as ID-2 counts it: a scalar 0, a container one more than its deepest child,
/// so the top-level object of `{}` is depth 1.
fn depth(j: &J) -> usize {
    match j {
        J::Arr(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        J::Obj(members) => 1 + members.iter().map(|(_, v)| depth(v)).max().unwrap_or(0),
        _ => 0,
    }
}

/// Number of objects in `j`.
fn objects(j: &J) -> usize {
    match j {
        J::Arr(items) => items.iter().map(objects).sum(),
        J::Obj(members) => 1 + members.iter().map(|(_, v)| objects(v)).sum::<usize>(),
        _ => 0,
    }
}

/// Repeats a key in the `k`-th object (pre-order) that has one, with a different value.
/// Returns whether it did.
fn repeat_a_key(j: &mut J, k: &mut usize) -> bool {
    match j {
        J::Arr(items) => items.iter_mut().any(|v| repeat_a_key(v, k)),
        J::Obj(members) => {
            if *k == 0 && !members.is_empty() {
                let key = members[0].0.clone();
                let at = members.len() / 2 + 1;
                members.insert(at.min(members.len()), (key, J::Str("again".into())));
                return true;
            }
            *k = k.saturating_sub(1);
            members.iter_mut().any(|(_, v)| repeat_a_key(v, k))
        }
        _ => false,
    }
}

/// SplitMix64: every spelling choice of one document comes from one seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n
    }
}

/// Writes `j` as JSON in one of its many spellings: members in shuffled order, any JSON
/// whitespace (or none) between tokens, each character literal or escaped (short escapes,
/// `\/`, `\u` in either case, surrogate pairs for astral characters).
fn spell(j: &J, rng: &mut Rng, out: &mut String) {
    fn ws(rng: &mut Rng, out: &mut String) {
        if rng.below(3) == 0 {
            for _ in 0..rng.below(4) {
                out.push([' ', '\t', '\n', '\r'][rng.below(4) as usize]);
            }
        }
    }
    fn string(s: &str, rng: &mut Rng, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            let short = match c {
                '"' => Some("\\\""),
                '\\' => Some("\\\\"),
                '/' => Some("\\/"),
                '\u{8}' => Some("\\b"),
                '\u{9}' => Some("\\t"),
                '\u{a}' => Some("\\n"),
                '\u{c}' => Some("\\f"),
                '\u{d}' => Some("\\r"),
                _ => None,
            };
            let must = c < ' ' || c == '"' || c == '\\';
            match (must || rng.below(5) == 0, short, rng.below(2)) {
                (false, _, _) => out.push(c),
                (true, Some(s), 0) => out.push_str(s),
                _ => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        if rng.below(2) == 0 {
                            out.push_str(&format!("\\u{u:04x}"));
                        } else {
                            out.push_str(&format!("\\u{u:04X}"));
                        }
                    }
                }
            }
        }
        out.push('"');
    }
    match j {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Num(n) => out.push_str(n),
        J::Str(s) => string(s, rng, out),
        J::Arr(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(rng, out);
                spell(item, rng, out);
                ws(rng, out);
            }
            out.push(']');
        }
        J::Obj(members) => {
            let mut order: Vec<usize> = (0..members.len()).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            out.push('{');
            ws(rng, out);
            for (n, &i) in order.iter().enumerate() {
                if n > 0 {
                    out.push(',');
                    ws(rng, out);
                }
                string(&members[i].0, rng, out);
                ws(rng, out);
                out.push(':');
                ws(rng, out);
                spell(&members[i].1, rng, out);
                ws(rng, out);
            }
            out.push('}');
        }
    }
}

fn spelled(j: &J, seed: u64) -> String {
    let mut rng = Rng(seed);
    let mut out = String::new();
    let pad: String = (0..rng.below(3)).map(|_| '\n').collect();
    out.push_str(&pad);
    spell(j, &mut rng, &mut out);
    out.push_str(&pad);
    out
}

/// The canonical form of `j` by ID-1, written independently of the parser: keys sorted with
/// `encode_utf16`, strings escaped character by character, numbers as spelled.
fn reference(j: &J, out: &mut String) {
    fn string(s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\u{8}' => out.push_str("\\b"),
                '\u{9}' => out.push_str("\\t"),
                '\u{a}' => out.push_str("\\n"),
                '\u{c}' => out.push_str("\\f"),
                '\u{d}' => out.push_str("\\r"),
                c if c < ' ' => out.push_str(&format!("\\u{:04x}", c as u32)),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    match j {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Num(n) => out.push_str(n),
        J::Str(s) => string(s, out),
        J::Arr(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                reference(item, out);
            }
            out.push(']');
        }
        J::Obj(members) => {
            let mut sorted: Vec<&(String, J)> = members.iter().collect();
            sorted.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
            out.push('{');
            for (i, (k, v)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                string(k, out);
                out.push(':');
                reference(v, out);
            }
            out.push('}');
        }
    }
}

/// What serde_json's parser found in a document: the top level's kind, the container depth
/// (counted as [`depth`] does) and whether some object repeats a decoded key. Deserialising
/// into it makes serde_json decode every string and key (so it checks UTF-8 and surrogate
/// escapes) and visit every number.
#[derive(Debug, Clone, Copy)]
struct Shape {
    object: bool,
    depth: usize,
    duplicate_key: bool,
}

impl Shape {
    const SCALAR: Shape = Shape {
        object: false,
        depth: 0,
        duplicate_key: false,
    };

    /// Whether ID-2 accepts a document of this shape that serde_json parsed.
    fn acceptable(self) -> bool {
        self.object && !self.duplicate_key && self.depth <= MAX_DEPTH
    }
}

struct ShapeVisitor;

impl<'de> Visitor<'de> for ShapeVisitor {
    type Value = Shape;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Shape, E> {
        Ok(Shape::SCALAR)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Shape, E> {
        Ok(Shape::SCALAR)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Shape, E> {
        Ok(Shape::SCALAR)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Shape, E> {
        Ok(Shape::SCALAR)
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Shape, E> {
        Ok(Shape::SCALAR)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Shape, E> {
        Ok(Shape::SCALAR)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Shape, A::Error> {
        let mut shape = Shape {
            object: false,
            depth: 1,
            duplicate_key: false,
        };
        while let Some(item) = seq.next_element::<Shape>()? {
            shape.depth = shape.depth.max(item.depth + 1);
            shape.duplicate_key |= item.duplicate_key;
        }
        Ok(shape)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Shape, A::Error> {
        let mut shape = Shape {
            object: true,
            depth: 1,
            duplicate_key: false,
        };
        let mut keys = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            shape.duplicate_key |= !keys.insert(key);
            let value: Shape = map.next_value()?;
            shape.depth = shape.depth.max(value.depth + 1);
            shape.duplicate_key |= value.duplicate_key;
        }
        Ok(shape)
    }
}

impl<'de> Deserialize<'de> for Shape {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Shape, D::Error> {
        d.deserialize_any(ShapeVisitor)
    }
}

/// serde_json's verdict on `bytes`.
enum Serde {
    /// Parsed: this shape.
    Parsed(Shape),
    /// Refused as not JSON (grammar, UTF-8, escapes, trailing data).
    Invalid(String),
    /// Refused for one of serde_json's own limits, which are not JSON's: a number beyond f64
    /// (`1e400`) or nesting past its recursion limit of 127. Says nothing about validity.
    OwnLimit,
}

fn serde_verdict(bytes: &[u8]) -> Serde {
    match serde_json::from_slice::<Shape>(bytes) {
        Ok(shape) => Serde::Parsed(shape),
        Err(e) => {
            let message = e.to_string();
            if message.starts_with("number out of range")
                || message.starts_with("recursion limit exceeded")
            {
                Serde::OwnLimit
            } else {
                Serde::Invalid(message)
            }
        }
    }
}

/// The canonical bytes of an accepted document are themselves accepted and unchanged, and mean
/// what the document meant (where serde_json can represent its numbers).
fn check_canonical_output(input: &[u8], bytes: &[u8]) -> Result<(), TestCaseError> {
    let again = canonicalize(bytes).map_err(|e| {
        TestCaseError::fail(format!(
            "canonical bytes {:?} refused: {e}",
            String::from_utf8_lossy(bytes)
        ))
    })?;
    prop_assert_eq!(
        &again.bytes,
        bytes,
        "canonical(canonical(x)) == canonical(x) for {:?}",
        String::from_utf8_lossy(input)
    );
    if let (Ok(x), Ok(y)) = (
        serde_json::from_slice::<serde_json::Value>(input),
        serde_json::from_slice::<serde_json::Value>(bytes),
    ) {
        prop_assert_eq!(x, y, "canonical bytes mean what the input meant");
    }
    Ok(())
}

/// Pieces of JSON, valid and not, for token soup: structure, literals and their near misses,
/// strings with escapes (a lone surrogate, a raw NUL), numbers and bad numbers, whitespace,
/// a BOM, bytes that are not UTF-8.
const JSON_TOKENS: &[&[u8]] = &[
    b"{",
    b"{",
    b"}",
    b"}",
    b"[",
    b"]",
    b",",
    b",",
    b":",
    b":",
    b"\"a\"",
    b"\"a\"",
    b"\"b\"",
    b"\"\\u0061\"",
    b"\"\\ud83d\\ude00\"",
    b"\"\\ud800\"",
    b"\"\\udc00x\"",
    b"\"\\x\"",
    b"\"\0\"",
    b"\"\xc3\xa9\"",
    b"\"\xc3\"",
    b"\"",
    b"\\",
    b"1",
    b"-0.5e+3",
    b"01",
    b"1.",
    b"-",
    b"1e999",
    b"true",
    b"false",
    b"null",
    b"nul",
    b"tru",
    b" ",
    b"\n",
    b"\t",
    b"\r",
    b"\x0c",
    b"\xef\xbb\xbf",
    b"\xff",
    b"\xc3\xa9",
    b"/",
    b"'a'",
];

/// Bytes that are sometimes JSON: token soup, a spelled document (any top level and depth,
/// sometimes with a repeated key) with up to two bytes changed, inserted or deleted or the
/// end cut off, or anything at all.
fn fuzz_bytes() -> impl Strategy<Value = Vec<u8>> {
    let soup = proptest::collection::vec(proptest::sample::select(JSON_TOKENS), 0..40)
        .prop_map(|tokens| tokens.concat());
    let edits = proptest::collection::vec((0u8..5, any::<usize>(), any::<u8>()), 0..3);
    let repeat = proptest::option::weighted(0.2, any::<usize>());
    let mutated =
        (any_document(), any::<u64>(), repeat, edits).prop_map(|(j, seed, repeat, edits)| {
            let mut j = j;
            let n = objects(&j);
            if let Some(k) = repeat.filter(|_| n > 0) {
                repeat_a_key(&mut j, &mut (k % n));
            }
            let mut bytes = spelled(&j, seed).into_bytes();
            for (kind, at, byte) in edits {
                let at = at % (bytes.len() + 1);
                const STRUCTURAL: &[u8] = b"{}[],:\"\\ 0e-";
                let structural = STRUCTURAL[usize::from(byte) % STRUCTURAL.len()];
                match kind {
                    0 if at < bytes.len() => bytes[at] = byte,
                    1 if at < bytes.len() => bytes[at] = structural,
                    2 => bytes.insert(at, structural),
                    3 if at < bytes.len() => {
                        bytes.remove(at);
                    }
                    _ => bytes.truncate(at),
                }
            }
            bytes
        });
    prop_oneof![
        2 => soup,
        2 => mutated,
        1 => proptest::collection::vec(any::<u8>(), 0..256),
    ]
}

proptest! {
    #![proptest_config(config())]

    /// Every valid JSON document, in any spelling, any top level, nested on either side of the
    /// limit, with or without a repeated key: serde_json accepts it (so the generator writes
    /// JSON), and `canonicalize` accepts it exactly when ID-2 allows (an object, at most
    /// MAX_DEPTH deep, no repeated key), refusing it otherwise with the error naming why. An
    /// accepted document's canonical bytes are the reference canonical form (ID-1), a fixed
    /// point, and mean what the document meant.
    #[test]
    fn canonical_parser_accepts_every_valid_json_document_serde_json_accepts_unless_id2_refuses_it(
        doc in any_document(),
        seed in any::<u64>(),
        repeat in proptest::option::weighted(0.15, any::<usize>()),
    ) {
        let mut doc = doc;
        let n = objects(&doc);
        let repeated = match repeat {
            Some(k) if n > 0 => repeat_a_key(&mut doc, &mut (k % n)),
            _ => false,
        };
        let text = spelled(&doc, seed);
        let deep = depth(&doc);
        let object = matches!(doc, J::Obj(_));

        // serde_json's grammar check (no depth or number limits) accepts the document.
        if let Err(e) = serde_json::from_str::<IgnoredAny>(&text) {
            return Err(TestCaseError::fail(format!("the generator wrote invalid JSON ({e}): {text:?}")));
        }
        // serde_json's parser agrees but for its own limits, and sees what was generated.
        match serde_verdict(text.as_bytes()) {
            Serde::Parsed(shape) => {
                prop_assert_eq!(shape.object, object);
                prop_assert_eq!(shape.depth, deep);
                prop_assert_eq!(shape.duplicate_key, repeated);
            }
            Serde::OwnLimit => {}
            Serde::Invalid(e) => {
                return Err(TestCaseError::fail(format!("serde_json refused valid JSON ({e}): {text:?}")));
            }
        }

        let got = canonicalize(text.as_bytes());
        match got {
            Ok(c) => {
                prop_assert!(
                    object && deep <= MAX_DEPTH && !repeated,
                    "accepted although ID-2 refuses it (object {}, depth {}, repeated key {}): {:?}",
                    object, deep, repeated, text
                );
                let mut expected = String::new();
                reference(&doc, &mut expected);
                prop_assert_eq!(String::from_utf8_lossy(&c.bytes), expected);
                check_canonical_output(text.as_bytes(), &c.bytes)?;
            }
            Err(e) => {
                let named = match &e {
                    CanonError::NotObject => !object,
                    CanonError::TooDeep => deep > MAX_DEPTH,
                    CanonError::DuplicateKey { .. } => repeated,
                    _ => false,
                };
                prop_assert!(
                    named,
                    "refused with {:?} (object {}, depth {}, repeated key {}): {:?}",
                    e, object, deep, repeated, text
                );
            }
        }
    }

    /// Any bytes — token soup, spelled documents with bytes changed, inserted, deleted or cut,
    /// random bytes: `canonicalize` never panics, and agrees with serde_json both ways: what it
    /// accepts serde_json parses as an object of at most MAX_DEPTH without a repeated key, and
    /// every such document serde_json parses, it accepts (IN-2, ID-2). An accepted document's
    /// canonical bytes are a fixed point and mean the same (ID-1).
    #[test]
    fn canonical_parser_never_panics_and_agrees_with_serde_json_on_arbitrary_bytes_id2_in2(
        bytes in fuzz_bytes(),
    ) {
        let got = canonicalize(&bytes);
        let serde = serde_verdict(&bytes);
        match (&got, &serde) {
            (_, Serde::OwnLimit) => {}
            (Ok(c), Serde::Parsed(shape)) => {
                prop_assert!(shape.acceptable(), "accepted {:?}, but serde_json sees {:?}", String::from_utf8_lossy(&bytes), shape);
                check_canonical_output(&bytes, &c.bytes)?;
            }
            (Ok(_), Serde::Invalid(e)) => {
                return Err(TestCaseError::fail(format!(
                    "accepted {:?}, which serde_json refuses: {e}", String::from_utf8_lossy(&bytes)
                )));
            }
            (Err(e), Serde::Parsed(shape)) => {
                prop_assert!(
                    !shape.acceptable(),
                    "refused {:?} ({}), which serde_json parses as {:?}", String::from_utf8_lossy(&bytes), e, shape
                );
            }
            (Err(_), Serde::Invalid(_)) => {}
        }
    }
}

// =============================================================================================
// Server-sent events
// =============================================================================================

/// Everything a parser delivers for `pieces`: the events in order, then how it ended.
fn run(mut parser: SseParser, pieces: &[&[u8]]) -> (Vec<SseEvent>, Result<Finish, SseError>) {
    let mut events = Vec::new();
    for piece in pieces {
        match parser.push(piece) {
            Ok(got) => events.extend(got),
            Err(err) => return (events, Err(err)),
        }
    }
    (events, parser.finish())
}

/// `input` cut at `cuts` (any positions, taken modulo the length, sorted).
fn split<'a>(input: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
    cuts.sort_unstable();
    let mut pieces = Vec::new();
    let mut start = 0;
    for cut in cuts {
        pieces.push(&input[start..cut]);
        start = cut;
    }
    pieces.push(&input[start..]);
    pieces
}

/// A second reading of the event-stream rules (WHATWG §9.2.6 with holdfast's documented
/// differences, `src/sse.rs`), written for clarity rather than speed: the whole input is cut
/// into lines first, then each line is interpreted. Shares no code with [`SseParser`].
fn reference_sse(
    input: &[u8],
    max_line: usize,
    max_event: usize,
) -> (Vec<SseEvent>, Result<Finish, SseError>) {
    // Lines: CRLF, LF or a lone CR ends one; what follows the last line end is a partial line.
    let mut lines: Vec<&[u8]> = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < input.len() {
        match input[i] {
            b'\r' => {
                lines.push(&input[start..i]);
                i += if input.get(i + 1) == Some(&b'\n') {
                    2
                } else {
                    1
                };
                start = i;
            }
            b'\n' => {
                lines.push(&input[start..i]);
                i += 1;
                start = i;
            }
            _ => i += 1,
        }
    }
    let partial = &input[start..];

    let mut events = Vec::new();
    let (mut data, mut event, mut last_id) = (String::new(), String::new(), String::new());
    let mut retry: Option<u64> = None;
    let dispatch =
        |data: &mut String, event: &mut String, last_id: &str, retry: &mut Option<u64>| {
            if data.is_empty() {
                event.clear();
                return None;
            }
            let mut text = std::mem::take(data);
            text.pop();
            Some(SseEvent {
                event: (!event.is_empty()).then(|| std::mem::take(event)),
                data: text,
                id: (!last_id.is_empty()).then(|| last_id.to_string()),
                retry: retry.take(),
            })
        };
    for (n, line) in lines.iter().enumerate() {
        if line.len() > max_line {
            return (events, Err(SseError::LineTooLong(max_line)));
        }
        let line = if n == 0 {
            line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line)
        } else {
            line
        };
        let Ok(line) = std::str::from_utf8(line) else {
            return (events, Err(SseError::InvalidUtf8));
        };
        if line.is_empty() {
            events.extend(dispatch(&mut data, &mut event, &last_id, &mut retry));
            continue;
        }
        let (field, value) = match line.find(':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(' ').unwrap_or(value))
            }
            None => (line, ""),
        };
        match field {
            "event" => event = value.to_string(),
            "data" => {
                // The data buffer holds each value and its LF; it may not pass max_event.
                if data.len() + value.len() > max_event {
                    return (events, Err(SseError::EventTooLarge(max_event)));
                }
                data.push_str(value);
                data.push('\n');
            }
            "id" if !value.contains('\0') => last_id = value.to_string(),
            "retry" if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) => {
                if let Ok(ms) = value.parse() {
                    retry = Some(ms);
                }
            }
            _ => {}
        }
    }
    if partial.len() > max_line {
        return (events, Err(SseError::LineTooLong(max_line)));
    }
    let pending = dispatch(&mut data, &mut event, &last_id, &mut retry);
    let clean = partial.is_empty() && pending.is_none();
    (events, Ok(Finish { pending, clean }))
}

/// Pieces of event streams: field names with and without colon and space, values that count
/// and values that do not (an id with NUL, a retry that is not all digits or too large), every
/// line end, comments, a BOM, a multi-byte character.
const SSE_TOKENS: &[&[u8]] = &[
    b"data",
    b"data:",
    b"data: ",
    b"data:  x",
    b"data: {\"a\":1}",
    b"data: [DONE]",
    b"event:",
    b"event: delta",
    b"event:x",
    b"id:",
    b"id: 7",
    b"id: a\0b",
    b"retry:",
    b"retry: 10",
    b"retry: 1x",
    b"retry: 99999999999999999999999",
    b":",
    b": keep-alive",
    b"foo: bar",
    b"event",
    b"id",
    b" ",
    b"x",
    b":",
    b"\r",
    b"\n",
    b"\n",
    b"\r\n",
    b"\r\n",
    b"\n\n",
    b"\n\n",
    b"\r\r",
    b"\xEF\xBB\xBF",
    b"\xC3\xA9",
    b"\xF0\x9F\x98\x80",
];

/// Pieces that break a stream: half a character, bytes that are never UTF-8.
const SSE_BAD_TOKENS: &[&[u8]] = &[b"\xC3", b"\xA9", b"\xFF", b"\xF0\x9F"];

/// (max_line, max_event): the defaults, or limits small enough that streams hit them.
fn any_limits() -> impl Strategy<Value = (usize, usize)> {
    prop_oneof![
        2 => Just((sse::DEFAULT_LIMIT, sse::DEFAULT_LIMIT)),
        1 => (4usize..96, 4usize..128),
    ]
}

/// One line of an event stream as a provider might write it, or nearly: a field name, a
/// separator, a value and a line end (or two, which dispatches).
fn stream_line() -> impl Strategy<Value = Vec<u8>> {
    let field = proptest::sample::select(vec![
        "data",
        "data",
        "data",
        "event",
        "id",
        "retry",
        "",
        "foo",
        "Data",
        "\u{feff}data",
    ]);
    let separator = proptest::sample::select(vec![":", ": ", ": ", ":  ", ""]);
    let value = proptest::sample::select(vec![
        "",
        "x",
        "7",
        "10",
        "1x",
        "a\0b",
        "{\"a\":1}",
        "[DONE]",
        "é😀",
        " y",
        "a:b",
        "99999999999999999999999",
    ]);
    let end = proptest::sample::select(vec!["\n", "\r", "\r\n", "\n\n", "\r\n\r\n", "\r\r"]);
    (field, separator, value, end).prop_map(|(f, s, v, e)| format!("{f}{s}{v}{e}").into_bytes())
}

/// Bytes that are sometimes an event stream: lines, token soup (now and then with bytes that
/// are not UTF-8), or anything at all.
fn stream_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => proptest::collection::vec(stream_line(), 0..16).prop_map(|lines| lines.concat()),
        3 => proptest::collection::vec(
            prop_oneof![
                200 => proptest::sample::select(SSE_TOKENS),
                1 => proptest::sample::select(SSE_BAD_TOKENS),
            ],
            0..60,
        )
        .prop_map(|tokens| tokens.concat()),
        1 => proptest::collection::vec(any::<u8>(), 0..256),
    ]
}

/// One event to encode: id, name (anything, line breaks included: `encode` cuts it), data
/// (anything, CR and CRLF included), and a keep-alive comment before it or not.
fn any_encoded_event() -> impl Strategy<Value = (Option<u64>, Option<String>, String, bool)> {
    let text = proptest::collection::vec(
        prop_oneof![
            4 => proptest::char::range('a', 'e'),
            1 => proptest::sample::select(vec!['\r', '\n', ' ', ':', '\0', 'é', '😀']),
        ],
        0..12,
    )
    .prop_map(|v| v.into_iter().collect::<String>());
    (
        proptest::option::of(any::<u64>()),
        proptest::option::of(text.clone()),
        text,
        any::<bool>(),
    )
}

proptest! {
    #![proptest_config(config())]

    /// Any bytes, under the default limits or small ones, given to the parser whole, cut at
    /// random places, and one byte at a time: never a panic, and always the events and ending
    /// that a second, line-at-a-time reading of the rules gives for the whole input (LC-7,
    /// IN-2): the same events however the bytes are split.
    #[test]
    fn sse_parser_gives_the_reference_events_however_the_bytes_are_split_lc7_in2(
        input in stream_bytes(),
        (max_line, max_event) in any_limits(),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let expected = reference_sse(&input, max_line, max_event);
        let parser = || SseParser::with_limits(max_line, max_event);
        prop_assert_eq!(&run(parser(), &[&input]), &expected, "whole: {:?}", String::from_utf8_lossy(&input));
        prop_assert_eq!(&run(parser(), &split(&input, &cuts)), &expected, "cut at {:?}", cuts);
        let bytes: Vec<&[u8]> = input.chunks(1).collect();
        prop_assert_eq!(&run(parser(), &bytes), &expected, "one byte at a time");
    }

    /// A stream of encoded events and keep-alive comments, cut anywhere, parses back to the
    /// events: data with CR and CRLF arrives with LF, a name is cut at its first line break,
    /// the last id stays in force (RS-4, RD-2).
    #[test]
    fn encoded_event_streams_parse_back_to_their_events_under_any_split_rd2(
        events in proptest::collection::vec(any_encoded_event(), 0..8),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let mut stream = Vec::new();
        let mut expected = Vec::new();
        let mut id = None;
        for (event_id, name, data, keepalive) in &events {
            if *keepalive {
                stream.extend_from_slice(&sse::comment("keep-alive"));
            }
            stream.extend_from_slice(&sse::encode(*event_id, name.as_deref(), data));
            if event_id.is_some() {
                id = event_id.map(|i| i.to_string());
            }
            expected.push(SseEvent {
                event: name
                    .as_deref()
                    .and_then(|n| n.split(['\r', '\n']).next())
                    .filter(|n| !n.is_empty())
                    .map(str::to_owned),
                data: data.replace("\r\n", "\n").replace('\r', "\n"),
                id: id.clone(),
                retry: None,
            });
        }
        let clean = Finish { pending: None, clean: true };
        prop_assert_eq!(run(SseParser::new(), &split(&stream, &cuts)), (expected, Ok(clean)));
    }
}
