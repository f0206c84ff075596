//! Canonical JSON and the request hash (SPEC §2, ID-1 .. ID-3b).
//!
//! # Canonical form (ID-1, ID-2)
//!
//! [`canonicalize`] parses a request body once, straight from bytes, and writes its canonical form:
//!
//! - the body must be one JSON object (ID-2); JSON whitespace (space, tab, LF, CR) is allowed
//!   around it and nothing else;
//! - object keys are sorted by the UTF-16 code units of the *decoded* key, as RFC 8785 §3.2.3
//!   sorts them, at every depth; arrays keep their order; no whitespace between tokens;
//! - strings are decoded (escapes, surrogate pairs) and re-encoded in RFC 8785 / ECMAScript
//!   `JSON.stringify` form: `\"`, `\\`, `\b`, `\t`, `\n`, `\f`, `\r`, other U+0000..U+001F as
//!   `\u00xx` (lower-case hex), everything else as literal UTF-8; no Unicode normalisation;
//! - numbers are validated against the JSON grammar and copied **exactly as spelled**
//!   (`1`, `1.0` and `1e0` stay three different values);
//! - refused (ID-2): invalid JSON, a non-object top level, a key repeated in one object (compared
//!   after decoding, so `"a"` and `"\u0061"` collide), invalid UTF-8, a lone surrogate escape, and
//!   nesting deeper than [`MAX_DEPTH`]. The parser recurses at most `MAX_DEPTH + 1` frames, because
//!   the depth is checked before each descent.
//!
//! The body's UTF-8 is checked once up front; then one pass writes the output as it parses.
//! Members of each object are written in input order and, when the object closes, sorted by key
//! and moved into place if needed (nested objects are already canonical by then). Runs of plain
//! string bytes are copied whole; keys without escapes are compared straight from the input.
//!
//! The same pass records the top-level `model` (decoded, and its token's byte range in the input)
//! and whether the top-level `stream` is the literal `true`.
//!
//! # Model rewriting (ID-3, ID-3b)
//!
//! [`Canonical::with_model`] gives the canonical body with the model replaced: that is what gets
//! hashed (ID-3 hashes the body *after* rewriting). [`rewrite_model`] replaces only the model token
//! in the client's own bytes: that is what the provider receives (ID-3b), so key order, spacing and
//! number spelling stay the client's. `canonicalize(&rewrite_model(b, span, m))` equals
//! `with_model(m)`.
//!
//! # Hash input layout (ID-3, ID-3a)
//!
//! [`request_hash`] is SHA-256 over the concatenation below, where `field(x)` is the byte length of
//! `x` as a big-endian `u64` followed by the bytes of `x`. Every variable-length part carries its
//! length, so two different inputs never share a preimage.
//!
//! ```text
//! field(CANONICAL_VERSION)
//! field(route)
//! field(backend)
//! u64be(number of headers)
//! for each header, sorted by (lower-cased name, value):
//!     field(lower-cased name) field(value)
//! field(canonical body, after model rewriting)
//! field(model), only for a route that takes its model in the path (GM-1)
//! ```
//!
//! Bump [`CANONICAL_VERSION`] whenever the canonical form or this layout changes: every stored
//! hash then stops matching, which is the intent.

use std::cmp::Ordering;
use std::ops::Range;

use sha2::{Digest, Sha256};

/// Version tag mixed into every request hash (ID-3). Change it when the canonical form changes.
pub const CANONICAL_VERSION: &str = "holdfast-canonical-v1";

/// Deepest nesting of objects and arrays accepted (ID-2). The top-level object is depth 1, so a
/// container nested 128 deep is accepted and one nested 129 deep is refused.
pub const MAX_DEPTH: usize = 128;

/// Why a body was refused (ID-2). Offsets are byte offsets into the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CanonError {
    /// Not JSON: unexpected byte, unexpected end, bad number, bad escape, raw control character
    /// in a string, or data after the top-level value.
    #[error("body is not valid JSON: {reason} at byte {offset}")]
    Syntax {
        /// Where.
        offset: usize,
        /// What was wrong there.
        reason: &'static str,
    },
    /// Valid JSON whose top-level value is not an object.
    #[error("body must be a JSON object")]
    NotObject,
    /// One object holds two keys that are equal after decoding; `offset` is the second one's.
    #[error("duplicate key {key:?} in one object at byte {offset}")]
    DuplicateKey {
        /// The repeated key, decoded.
        key: String,
        /// Where its second occurrence starts.
        offset: usize,
    },
    /// A byte sequence that is not UTF-8, inside or outside a string.
    #[error("body is not valid UTF-8 at byte {offset}")]
    InvalidUtf8 {
        /// Where.
        offset: usize,
    },
    /// A `\uD800`..`\uDFFF` escape that is not a high surrogate followed by a low one; `offset` is
    /// the escape's backslash.
    #[error("lone surrogate escape at byte {offset}")]
    LoneSurrogate {
        /// Where the escape's backslash is.
        offset: usize,
    },
    /// More than [`MAX_DEPTH`] nested objects and arrays.
    #[error("body nests deeper than {MAX_DEPTH} levels")]
    TooDeep,
}

/// Result of canonicalising one request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Canonical {
    /// The canonical bytes (ID-1).
    pub bytes: Vec<u8>,
    /// Decoded top-level "model" string, if the key exists and is a string.
    pub model: Option<String>,
    /// Byte range in the INPUT of the top-level "model" value token (quotes included), if the key
    /// exists and its value is a string. Feed it to [`rewrite_model`].
    pub model_span: Option<Range<usize>>,
    /// True iff the top-level "stream" member is the literal `true`.
    pub stream: bool,
    /// True iff the top-level object has a "stream_options" member (whatever its value): the
    /// client chose what its OpenAI stream reports (decision 40).
    pub stream_options: bool,
    /// Byte range of the model value token inside `bytes`, for [`Canonical::with_model`].
    model_out: Option<Range<usize>>,
}

/// Canonicalises one request body (ID-1), refusing what ID-2 refuses.
///
/// # Errors
///
/// A [`CanonError`] naming the first problem found. Invalid UTF-8 anywhere is reported first
/// (the encoding is checked before parsing); after that, problems are found scanning left to
/// right. A duplicate key is detected when its object closes, so a syntax error later inside the
/// same object wins. A non-object top level is reported only once the whole value has parsed.
pub fn canonicalize(body: &[u8]) -> Result<Canonical, CanonError> {
    // RFC 8259 §8.1: JSON text is UTF-8. Checking the whole body first (several GB/s) is cheaper
    // than checking each string run, and lets the parser copy runs without looking inside them.
    if let Err(e) = std::str::from_utf8(body) {
        return Err(CanonError::InvalidUtf8 {
            offset: e.valid_up_to(),
        });
    }
    let mut p = Parser::new(body);
    p.skip_ws();
    let is_object = p.peek() == Some(b'{');
    p.parse_value(1)?;
    p.skip_ws();
    if p.pos < body.len() {
        return Err(p.syntax(p.pos, "trailing data after the top-level value"));
    }
    if !is_object {
        return Err(CanonError::NotObject);
    }
    Ok(Canonical {
        bytes: p.out,
        model: p.model,
        model_span: p.model_span,
        stream: p.stream,
        stream_options: p.stream_options,
        model_out: p.model_out,
    })
}

impl Canonical {
    /// Canonical bytes with the top-level model string replaced by `model` (canonically escaped).
    /// If there is no string model, returns bytes unchanged (clone). Hash this (ID-3).
    pub fn with_model(&self, model: &str) -> Vec<u8> {
        let Some(r) = &self.model_out else {
            return self.bytes.clone();
        };
        splice_string(&self.bytes, r.clone(), model)
    }
}

/// ID-3b: the client's original body bytes with only the top-level model value token (at `span`,
/// from [`Canonical::model_span`]) replaced by `model` as a JSON string (canonical escaping).
/// Everything else is byte-identical. A `span` that does not lie inside `body` returns `body`
/// unchanged.
pub fn rewrite_model(body: &[u8], span: Range<usize>, model: &str) -> Vec<u8> {
    splice_string(body, span, model)
}

/// ID-3/ID-3a: SHA-256 over [`CANONICAL_VERSION`], route, backend, headers (sorted by lower-cased
/// name, then value; names lower-cased in ASCII, values as given), and the canonical body.
/// Every field is length-prefixed (u64 big-endian byte length) so no two different inputs share a
/// preimage; the header count is prefixed too. See the module docs for the exact layout.
pub fn request_hash(
    route: &str,
    backend: &str,
    headers: &[(&str, &str)],
    canonical: &[u8],
) -> [u8; 32] {
    request_hash_of(route, backend, headers, canonical, None)
}

/// [`request_hash`] for a route that takes its model in the path (GM-1): the model (after
/// rewriting) is hashed last, so the same body sent to another model is another request.
pub fn request_hash_with_path_model(
    route: &str,
    backend: &str,
    headers: &[(&str, &str)],
    canonical: &[u8],
    model: &str,
) -> [u8; 32] {
    request_hash_of(route, backend, headers, canonical, Some(model))
}

fn request_hash_of(
    route: &str,
    backend: &str,
    headers: &[(&str, &str)],
    canonical: &[u8],
    path_model: Option<&str>,
) -> [u8; 32] {
    fn field(h: &mut Sha256, bytes: &[u8]) {
        h.update((bytes.len() as u64).to_be_bytes());
        h.update(bytes);
    }
    let mut sorted: Vec<(String, &str)> = headers
        .iter()
        .map(|(name, value)| (name.to_ascii_lowercase(), *value))
        .collect();
    sorted.sort_unstable();

    let mut h = Sha256::new();
    field(&mut h, CANONICAL_VERSION.as_bytes());
    field(&mut h, route.as_bytes());
    field(&mut h, backend.as_bytes());
    h.update((sorted.len() as u64).to_be_bytes());
    for (name, value) in &sorted {
        field(&mut h, name.as_bytes());
        field(&mut h, value.as_bytes());
    }
    field(&mut h, canonical);
    if let Some(model) = path_model {
        field(&mut h, model.as_bytes());
    }
    h.finalize().into()
}

/// `bytes` with `span` replaced by `s` written as a canonical JSON string.
fn splice_string(bytes: &[u8], span: Range<usize>, s: &str) -> Vec<u8> {
    let (Some(head), Some(tail)) = (bytes.get(..span.start), bytes.get(span.end..)) else {
        return bytes.to_vec();
    };
    if span.start > span.end {
        return bytes.to_vec();
    }
    let mut out = Vec::with_capacity(head.len() + s.len() + 2 + tail.len());
    out.extend_from_slice(head);
    write_json_string(&mut out, s);
    out.extend_from_slice(tail);
    out
}

/// Writes `s` as a JSON string in canonical (RFC 8785) escape form.
fn write_json_string(out: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    out.push(b'"');
    let mut run = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if b == b'"' || b == b'\\' || b < 0x20 {
            out.extend_from_slice(&bytes[run..i]);
            push_escaped_ascii(out, b);
            run = i + 1;
        }
    }
    out.extend_from_slice(&bytes[run..]);
    out.push(b'"');
}

/// Canonical escape of `"`, `\` or a control character (RFC 8785 §3.2.2.2).
fn push_escaped_ascii(out: &mut Vec<u8>, b: u8) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    match b {
        b'"' => out.extend_from_slice(b"\\\""),
        b'\\' => out.extend_from_slice(b"\\\\"),
        0x08 => out.extend_from_slice(b"\\b"),
        0x09 => out.extend_from_slice(b"\\t"),
        0x0A => out.extend_from_slice(b"\\n"),
        0x0C => out.extend_from_slice(b"\\f"),
        0x0D => out.extend_from_slice(b"\\r"),
        _ => {
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(b >> 4)]);
            out.push(HEX[usize::from(b & 0xF)]);
        }
    }
}

/// Orders two UTF-8 strings by their UTF-16 code units (RFC 8785 §3.2.3).
///
/// UTF-8 byte order is code point order, which matches UTF-16 order except that U+E000..U+FFFF
/// (UTF-8 lead byte 0xEE/0xEF) sorts *after* the supplementary planes (lead 0xF0..0xF4, UTF-16
/// lead surrogate 0xD800..0xDBFF). Both strings share every byte before the first difference, so
/// that byte is a character start in both or a continuation byte in both.
fn cmp_utf16(a: &[u8], b: &[u8]) -> Ordering {
    match a.iter().zip(b).find(|(x, y)| x != y) {
        None => a.len().cmp(&b.len()),
        Some((&x, &y)) => {
            let bmp_high = |c: u8| c == 0xEE || c == 0xEF;
            if bmp_high(x) && y >= 0xF0 {
                Ordering::Greater
            } else if x >= 0xF0 && bmp_high(y) {
                Ordering::Less
            } else {
                x.cmp(&y)
            }
        }
    }
}

/// Index of the first byte at or after `i` that ends a plain string run: `"`, `\`, a control
/// character, or the end of input. Eight bytes at a time; the lowest flagged byte is exact.
fn scan_plain(input: &[u8], i: usize) -> usize {
    const LO: u64 = 0x0101_0101_0101_0101;
    const HI: u64 = 0x8080_8080_8080_8080;
    let rest = input.get(i..).unwrap_or_default();
    let mut chunks = rest.chunks_exact(8);
    let mut done = 0;
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let w = u64::from_le_bytes(word);
        let q = w ^ (LO * u64::from(b'"'));
        let s = w ^ (LO * u64::from(b'\\'));
        let hits = ((q.wrapping_sub(LO) & !q)
            | (s.wrapping_sub(LO) & !s)
            | (w.wrapping_sub(LO * 0x20) & !w))
            & HI;
        if hits != 0 {
            return i + done + (hits.trailing_zeros() / 8) as usize;
        }
        done += 8;
    }
    for &b in chunks.remainder() {
        if b == b'"' || b == b'\\' || b < 0x20 {
            break;
        }
        done += 1;
    }
    i + done
}

/// Where a decoded string lives.
enum Text {
    /// Input bytes: the string had no escapes, so its raw bytes are its decoded bytes.
    Input(Range<usize>),
    /// Bytes of `Parser::keys`, where strings with escapes are decoded.
    Arena(Range<usize>),
}

/// Resolves [`Text`] ranges of one parse.
#[derive(Clone, Copy)]
struct Texts<'k> {
    input: &'k [u8],
    arena: &'k [u8],
}

impl<'k> Texts<'k> {
    fn get(self, t: &Text) -> &'k [u8] {
        match t {
            Text::Input(r) => &self.input[r.clone()],
            Text::Arena(r) => &self.arena[r.clone()],
        }
    }

    fn key(self, m: &Member) -> &'k [u8] {
        self.get(&m.key)
    }
}

/// One member of an object being parsed.
struct Member {
    /// Decoded key.
    key: Text,
    /// `"key":value` in canonical form, as a range of `Parser::out`.
    out: Range<usize>,
    /// Offset of the key's opening quote in the input.
    key_offset: usize,
}

/// Objects up to this many members are sorted by insertion (few keys is the common case).
const INSERTION_SORT_MAX: usize = 16;

/// Sorts small `members` by key in place. `Some(moved)` if sorted with all keys distinct;
/// `None` if there are too many members or two keys are equal (the caller then sorts fully and
/// finds the duplicate to report).
fn insertion_sort(members: &mut [Member], keys: Texts<'_>) -> Option<bool> {
    if members.len() > INSERTION_SORT_MAX {
        return None;
    }
    let mut moved = false;
    for i in 1..members.len() {
        for j in (1..=i).rev() {
            match cmp_utf16(keys.key(&members[j - 1]), keys.key(&members[j])) {
                Ordering::Less => break,
                Ordering::Equal => return None,
                Ordering::Greater => {
                    members.swap(j - 1, j);
                    moved = true;
                }
            }
        }
    }
    Some(moved)
}

/// In sorted `members`, the duplicate whose second occurrence comes first in the input.
fn first_duplicate(members: &[Member], keys: Texts<'_>) -> Option<CanonError> {
    members
        .windows(2)
        .filter(|w| keys.key(&w[0]) == keys.key(&w[1]))
        .min_by_key(|w| w[0].key_offset.max(w[1].key_offset))
        .map(|w| CanonError::DuplicateKey {
            key: String::from_utf8_lossy(keys.key(&w[0])).into_owned(),
            offset: w[0].key_offset.max(w[1].key_offset),
        })
}

/// Appends `members` to `dst` in slice order, comma-separated, taking each member's bytes from
/// `src` (where `src[0]` is at output offset `src_base`) and updating its range to `dst`.
fn lay_out(dst: &mut Vec<u8>, src: &[u8], src_base: usize, members: &mut [Member]) {
    for (i, m) in members.iter_mut().enumerate() {
        if i > 0 {
            dst.push(b',');
        }
        let start = dst.len();
        dst.extend_from_slice(&src[m.out.start - src_base..m.out.end - src_base]);
        m.out = start..dst.len();
    }
}

/// Single-pass recursive-descent parser writing canonical bytes as it goes.
///
/// Members of each object are written in input order; when the object closes they are sorted by
/// key and, if the order changed, their byte ranges are moved into place. Nested objects are
/// already canonical by then, so each level only moves bytes.
struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
    /// Canonical output.
    out: Vec<u8>,
    /// Decoded keys with escapes, of all open objects (a stack arena; each object truncates its
    /// part on close). Keys without escapes are not copied here: they are read from the input.
    keys: Vec<u8>,
    /// Members of all open objects (a stack; each object truncates its part on close).
    members: Vec<Member>,
    /// Reused buffer for reordering an object's members.
    scratch: Vec<u8>,
    model: Option<String>,
    model_span: Option<Range<usize>>,
    /// Offset of the model value inside its member's canonical bytes (`"model":` = 8).
    model_value_off: usize,
    model_out: Option<Range<usize>>,
    stream: bool,
    stream_options: bool,
}

impl<'a> Parser<'a> {
    fn new(input: &'a [u8]) -> Self {
        Parser {
            input,
            pos: 0,
            // Canonical form is never longer than the input: whitespace goes, escapes only shrink.
            out: Vec::with_capacity(input.len()),
            keys: Vec::new(),
            members: Vec::new(),
            scratch: Vec::new(),
            model: None,
            model_span: None,
            model_value_off: 0,
            model_out: None,
            stream: false,
            stream_options: false,
        }
    }

    fn texts(&self) -> Texts<'_> {
        Texts {
            input: self.input,
            arena: &self.keys,
        }
    }

    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    /// The error for an unexpected byte at `offset` (or for the end of input).
    fn syntax(&self, offset: usize, reason: &'static str) -> CanonError {
        if offset >= self.input.len() {
            return CanonError::Syntax {
                offset: self.input.len(),
                reason: "unexpected end of input",
            };
        }
        CanonError::Syntax { offset, reason }
    }

    /// Parses one value; `depth` is the depth a container starting here would have.
    fn parse_value(&mut self, depth: usize) -> Result<(), CanonError> {
        match self.peek() {
            Some(b'{') => self.parse_object(depth),
            Some(b'[') => self.parse_array(depth),
            Some(b'"') => self.parse_string(false).map(drop),
            Some(b'-' | b'0'..=b'9') => self.parse_number(),
            Some(b't') => self.parse_literal(b"true"),
            Some(b'f') => self.parse_literal(b"false"),
            Some(b'n') => self.parse_literal(b"null"),
            _ => Err(self.syntax(self.pos, "expected a JSON value")),
        }
    }

    fn parse_literal(&mut self, lit: &'static [u8]) -> Result<(), CanonError> {
        if !self.input[self.pos..].starts_with(lit) {
            return Err(self.syntax(self.pos, "expected a JSON value"));
        }
        self.pos += lit.len();
        self.out.extend_from_slice(lit);
        Ok(())
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`, copied verbatim (ID-1).
    fn parse_number(&mut self) -> Result<(), CanonError> {
        let input = self.input;
        let digit = |i: usize| input.get(i).is_some_and(u8::is_ascii_digit);
        let digits_from = |mut i: usize| {
            while digit(i) {
                i += 1;
            }
            i
        };
        let start = self.pos;
        let mut i = start;
        if input.get(i) == Some(&b'-') {
            i += 1;
        }
        match input.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => i = digits_from(i + 1),
            _ => return Err(self.syntax(i, "expected a digit")),
        }
        if input.get(i) == Some(&b'.') {
            i += 1;
            if !digit(i) {
                return Err(self.syntax(i, "expected a digit after the decimal point"));
            }
            i = digits_from(i);
        }
        if let Some(b'e' | b'E') = input.get(i) {
            i += 1;
            if let Some(b'+' | b'-') = input.get(i) {
                i += 1;
            }
            if !digit(i) {
                return Err(self.syntax(i, "expected a digit in the exponent"));
            }
            i = digits_from(i);
        }
        self.out.extend_from_slice(&input[start..i]);
        self.pos = i;
        Ok(())
    }

    fn parse_array(&mut self, depth: usize) -> Result<(), CanonError> {
        if depth > MAX_DEPTH {
            return Err(CanonError::TooDeep);
        }
        self.pos += 1;
        self.out.push(b'[');
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
            self.out.push(b']');
            return Ok(());
        }
        loop {
            self.skip_ws();
            self.parse_value(depth + 1)?;
            self.skip_ws();
            match self.peek() {
                Some(b',') => {
                    self.pos += 1;
                    self.out.push(b',');
                }
                Some(b']') => {
                    self.pos += 1;
                    self.out.push(b']');
                    return Ok(());
                }
                _ => return Err(self.syntax(self.pos, "expected ',' or ']'")),
            }
        }
    }

    fn parse_object(&mut self, depth: usize) -> Result<(), CanonError> {
        if depth > MAX_DEPTH {
            return Err(CanonError::TooDeep);
        }
        let top = depth == 1;
        self.pos += 1;
        self.out.push(b'{');
        let obj_start = self.out.len();
        let members_base = self.members.len();
        let keys_base = self.keys.len();
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            self.out.push(b'}');
            return Ok(());
        }
        loop {
            self.skip_ws();
            if self.peek() != Some(b'"') {
                return Err(self.syntax(self.pos, "expected a string key"));
            }
            let key_offset = self.pos;
            let member_start = self.out.len();
            let key = self.parse_string(true)?;
            self.skip_ws();
            if self.peek() != Some(b':') {
                return Err(self.syntax(self.pos, "expected ':'"));
            }
            self.pos += 1;
            self.out.push(b':');
            self.skip_ws();
            if top {
                self.parse_top_level_value(&key, member_start)?;
            } else {
                self.parse_value(depth + 1)?;
            }
            self.members.push(Member {
                key,
                out: member_start..self.out.len(),
                key_offset,
            });
            self.skip_ws();
            match self.peek() {
                Some(b',') => {
                    self.pos += 1;
                    self.out.push(b',');
                }
                Some(b'}') => {
                    self.pos += 1;
                    break;
                }
                _ => return Err(self.syntax(self.pos, "expected ',' or '}'")),
            }
        }
        self.sort_members(obj_start, members_base, top)?;
        self.members.truncate(members_base);
        self.keys.truncate(keys_base);
        self.out.push(b'}');
        Ok(())
    }

    /// A value of the top-level object: notes `model` and `stream` on the way.
    fn parse_top_level_value(&mut self, key: &Text, member_start: usize) -> Result<(), CanonError> {
        let name = self.texts().get(key);
        let (is_model, is_stream) = (name == b"model", name == b"stream");
        self.stream_options |= name == b"stream_options";
        let value_start = self.pos;
        if is_model && self.peek() == Some(b'"') {
            let out_start = self.out.len();
            let arena_len = self.keys.len();
            let text = self.parse_string(true)?;
            let decoded = String::from_utf8_lossy(self.texts().get(&text)).into_owned();
            self.keys.truncate(arena_len);
            self.model = Some(decoded);
            self.model_span = Some(value_start..self.pos);
            self.model_value_off = out_start - member_start;
        } else if is_stream {
            self.parse_value(2)?;
            self.stream = &self.input[value_start..self.pos] == b"true";
        } else {
            self.parse_value(2)?;
        }
        Ok(())
    }

    /// Sorts the members of the object whose canonical content starts at `out[obj_start]`,
    /// refuses duplicate keys, and moves member bytes into sorted order if it changed.
    fn sort_members(
        &mut self,
        obj_start: usize,
        members_base: usize,
        top: bool,
    ) -> Result<(), CanonError> {
        let Parser {
            input,
            keys,
            members,
            out,
            scratch,
            ..
        } = self;
        let keys = Texts { input, arena: keys };
        let members = &mut members[members_base..];
        let moved = match insertion_sort(members, keys) {
            Some(moved) => moved,
            None => {
                let less =
                    |a: &Member, b: &Member| cmp_utf16(keys.key(a), keys.key(b)) == Ordering::Less;
                if members.is_sorted_by(less) {
                    false
                } else {
                    members.sort_by(|a, b| cmp_utf16(keys.key(a), keys.key(b)));
                    if let Some(duplicate) = first_duplicate(members, keys) {
                        return Err(duplicate);
                    }
                    true
                }
            }
        };
        if moved {
            scratch.clear();
            if top {
                // `out` holds only this object: build the sorted copy beside it and swap.
                scratch.reserve(out.len());
                scratch.extend_from_slice(&out[..obj_start]);
                lay_out(scratch, out, 0, members);
                std::mem::swap(out, scratch);
            } else {
                scratch.extend_from_slice(&out[obj_start..]);
                out.truncate(obj_start);
                lay_out(out, scratch, obj_start, members);
            }
        }
        if top && self.model_span.is_some() {
            let off = self.model_value_off;
            self.model_out = members
                .iter()
                .find(|m| keys.key(m) == b"model")
                .map(|m| m.out.start + off..m.out.end);
        }
        Ok(())
    }

    /// Parses a string (at its opening quote) and writes its canonical form to `out`. Returns
    /// its decoded text if `decode` (a string with escapes is decoded into `keys`); otherwise the
    /// raw text between the quotes.
    ///
    /// Bytes are copied to `out` in runs, quotes included. A run is plain bytes plus, when not
    /// decoding, the two-byte escapes that are already canonical (`\"`, `\\`, `\b`, `\f`, `\n`,
    /// `\r`, `\t`); other escapes end a run and are rewritten. UTF-8 was validated up front, so
    /// runs are copied without looking inside them.
    fn parse_string(&mut self, decode: bool) -> Result<Text, CanonError> {
        let input = self.input;
        let open = self.pos;
        // Start of the bytes not yet copied to `out` (the opening quote at first).
        let mut run_start = open;
        // Where the decoded text starts in `keys`, once an escape had to be decoded.
        let mut arena_start = None;
        let mut pos = open + 1;
        loop {
            let end = scan_plain(input, pos);
            match input.get(end) {
                Some(b'"') => {
                    self.out.extend_from_slice(&input[run_start..=end]);
                    self.pos = end + 1;
                    return Ok(match arena_start {
                        None => Text::Input(open + 1..end),
                        Some(start) => {
                            self.keys.extend_from_slice(&input[run_start..end]);
                            Text::Arena(start..self.keys.len())
                        }
                    });
                }
                Some(b'\\') => {
                    let canonical_already = matches!(
                        input.get(end + 1),
                        Some(b'"' | b'\\' | b'b' | b'f' | b'n' | b'r' | b't')
                    );
                    if canonical_already && !decode {
                        pos = end + 2;
                        continue;
                    }
                    self.out.extend_from_slice(&input[run_start..end]);
                    if decode {
                        arena_start.get_or_insert(self.keys.len());
                        let plain = run_start.max(open + 1);
                        self.keys.extend_from_slice(&input[plain..end]);
                    }
                    self.pos = end;
                    self.parse_escape(decode)?;
                    pos = self.pos;
                    run_start = pos;
                }
                Some(_) => {
                    return Err(self.syntax(end, "raw control character in string"));
                }
                None => return Err(self.syntax(end, "unterminated string")),
            }
        }
    }

    /// Parses one escape (at its backslash) and writes the character it stands for.
    fn parse_escape(&mut self, decode: bool) -> Result<(), CanonError> {
        let start = self.pos;
        let lone = CanonError::LoneSurrogate { offset: start };
        let (c, len) = match self.input.get(start + 1) {
            Some(b'"') => (u32::from(b'"'), 2),
            Some(b'\\') => (u32::from(b'\\'), 2),
            Some(b'/') => (u32::from(b'/'), 2),
            Some(b'b') => (0x08, 2),
            Some(b'f') => (0x0C, 2),
            Some(b'n') => (0x0A, 2),
            Some(b'r') => (0x0D, 2),
            Some(b't') => (0x09, 2),
            Some(b'u') => match self.hex4(start + 2)? {
                high @ 0xD800..=0xDBFF => {
                    if self.input.get(start + 6..start + 8) != Some(b"\\u") {
                        return Err(lone);
                    }
                    let low = self.hex4(start + 8)?;
                    if !(0xDC00..=0xDFFF).contains(&low) {
                        return Err(lone);
                    }
                    (0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00), 12)
                }
                0xDC00..=0xDFFF => return Err(lone),
                c => (c, 6),
            },
            _ => return Err(self.syntax(start + 1, "invalid escape")),
        };
        let Some(ch) = char::from_u32(c) else {
            return Err(lone);
        };
        self.pos = start + len;
        let mut buf = [0u8; 4];
        let utf8 = ch.encode_utf8(&mut buf).as_bytes();
        match utf8 {
            [b] if *b < 0x20 || *b == b'"' || *b == b'\\' => push_escaped_ascii(&mut self.out, *b),
            _ => self.out.extend_from_slice(utf8),
        }
        if decode {
            self.keys.extend_from_slice(utf8);
        }
        Ok(())
    }

    /// Four hex digits at `at`.
    fn hex4(&self, at: usize) -> Result<u32, CanonError> {
        let mut v = 0;
        for i in at..at + 4 {
            let d = match self.input.get(i) {
                Some(&b @ b'0'..=b'9') => b - b'0',
                Some(&b @ b'a'..=b'f') => b - b'a' + 10,
                Some(&b @ b'A'..=b'F') => b - b'A' + 10,
                _ => return Err(self.syntax(i, "expected a hex digit in \\u escape")),
            };
            v = (v << 4) | u32::from(d);
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn canon(s: &str) -> Result<Canonical, CanonError> {
        canonicalize(s.as_bytes())
    }

    fn canon_str(s: &str) -> String {
        let c = canon(s).unwrap_or_else(|e| panic!("{s:?} refused: {e}"));
        String::from_utf8(c.bytes).unwrap()
    }

    fn hash(body: &str) -> [u8; 32] {
        request_hash(
            "/v1/chat/completions",
            "openai",
            &[],
            &canon(body).unwrap().bytes,
        )
    }

    fn is_syntax(r: Result<Canonical, CanonError>) -> bool {
        matches!(r, Err(CanonError::Syntax { .. }))
    }

    // ---- ID-1: canonical form ----

    #[test]
    fn keys_sort_by_utf16_code_units_rfc8785_example_id1() {
        // RFC 8785 §3.2.3 example object and expected order.
        let input = r#"{
            "\u20ac": "Euro Sign",
            "\r": "Carriage Return",
            "\ufb33": "Hebrew Letter Dalet With Dagesh",
            "1": "One",
            "\ud83d\ude00": "Emoji: Grinning Face",
            "\u0080": "Control",
            "\u00f6": "Latin Small Letter O With Diaeresis"
        }"#;
        let expected = concat!(
            r#"{"\r":"Carriage Return","1":"One","#,
            "\"\u{80}\":\"Control\",",
            "\"\u{f6}\":\"Latin Small Letter O With Diaeresis\",",
            "\"\u{20ac}\":\"Euro Sign\",",
            "\"\u{1f600}\":\"Emoji: Grinning Face\",",
            "\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}",
        );
        assert_eq!(canon_str(input), expected);
    }

    #[test]
    fn keys_sort_by_decoded_value_not_escaped_form_id1() {
        // Decoded: '"' (0x22) < '#' (0x23) < '\' (0x5C), although `\"` starts with 0x5C.
        assert_eq!(
            canon_str(r##"{"\\":3,"#":2,"\"":1}"##),
            r##"{"\"":1,"#":2,"\\":3}"##
        );
    }

    #[test]
    fn prefix_key_sorts_before_longer_key_id1() {
        assert_eq!(canon_str(r#"{"ab":2,"a":1}"#), r#"{"a":1,"ab":2}"#);
    }

    #[test]
    fn escape_forms_normalise_to_one_spelling_id1() {
        assert_eq!(canon_str(r#"{"a":"\u0041"}"#), canon_str(r#"{"a":"A"}"#));
        assert_eq!(canon_str(r#"{"a":"\/"}"#), r#"{"a":"/"}"#);
        assert_eq!(canon_str(r#"{"a":"\u00e9"}"#), canon_str(r#"{"a":"é"}"#));
        assert_eq!(canon_str(r#"{"a":"\u00E9"}"#), "{\"a\":\"\u{e9}\"}");
        assert_eq!(
            canon_str(r#"{"a":"\ud83d\ude00"}"#),
            canon_str("{\"a\":\"\u{1f600}\"}")
        );
        assert_eq!(canon_str(r#"{"\u0061":1}"#), r#"{"a":1}"#);
    }

    #[test]
    fn control_characters_reescape_in_rfc8785_form_id1() {
        let input =
            r#"{"a":"\u0000\u0001\u0008\u0009\u000A\u000c\u000d\u001F\b\f\n\r\t\u007f\u2028\"\\"}"#;
        let expected =
            "{\"a\":\"\\u0000\\u0001\\b\\t\\n\\f\\r\\u001f\\b\\f\\n\\r\\t\u{7f}\u{2028}\\\"\\\\\"}";
        assert_eq!(canon_str(input), expected);
        // `\u0022` and `\u005c` come out as the short escapes.
        assert_eq!(canon_str(r#"{"a":"\u0022\u005C"}"#), r#"{"a":"\"\\"}"#);
    }

    #[test]
    fn numbers_keep_their_spelling_id1() {
        let spellings = ["1", "1.0", "1e0", "1E0", "1e+0", "-0", "0.10"];
        let bodies: Vec<String> = spellings
            .iter()
            .map(|n| format!(r#"{{"n":{n}}}"#))
            .collect();
        for (body, n) in bodies.iter().zip(spellings) {
            assert_eq!(canon_str(body), format!(r#"{{"n":{n}}}"#));
        }
        for (i, a) in bodies.iter().enumerate() {
            for b in &bodies[i + 1..] {
                assert_ne!(canon_str(a), canon_str(b));
                assert_ne!(hash(a), hash(b));
            }
        }
    }

    #[test]
    fn huge_numbers_are_copied_verbatim_id1() {
        let n = format!(
            "-{}.{}e-{}",
            "9".repeat(1000),
            "0".repeat(500),
            "7".repeat(40)
        );
        assert_eq!(
            canon_str(&format!("{{\"n\":{n}}}")),
            format!("{{\"n\":{n}}}")
        );
    }

    #[test]
    fn whitespace_and_key_order_do_not_change_output_id1() {
        let a = r#"{"b":{"y":[3,2,1],"x":null},"a":true,"c":"s"}"#;
        let b =
            " \r\n\t{ \"c\" : \"s\" ,\n \"a\":true,\t\"b\" :{ \"x\" :null , \"y\":[ 3 , 2,1 ]}}\n ";
        assert_eq!(
            canon_str(a),
            r#"{"a":true,"b":{"x":null,"y":[3,2,1]},"c":"s"}"#
        );
        assert_eq!(canon_str(a), canon_str(b));
        assert_eq!(hash(a), hash(b));
    }

    #[test]
    fn nested_objects_sorted_and_arrays_kept_in_order_id1() {
        assert_eq!(
            canon_str(r#"{"z":[{"b":1,"a":2},[{"d":0,"c":0}]],"y":{}}"#),
            r#"{"y":{},"z":[{"a":2,"b":1},[{"c":0,"d":0}]]}"#
        );
        assert_eq!(canon_str(r#"{"a":[]}"#), r#"{"a":[]}"#);
    }

    #[test]
    fn unicode_is_not_normalised_id1() {
        // U+00E9 and "e" + U+0301 are different keys and different values.
        let c = canon_str("{\"\u{e9}\":1,\"e\u{301}\":2}");
        assert_eq!(c, "{\"e\u{301}\":2,\"\u{e9}\":1}");
    }

    // ---- ID-2: refusals ----

    #[test]
    fn duplicate_keys_are_refused_id2() {
        assert_eq!(
            canon(r#"{"a":1,"b":2,"a":3}"#),
            Err(CanonError::DuplicateKey {
                key: "a".into(),
                offset: 13
            })
        );
        assert_eq!(
            canon(r#"{"a":1,"\u0061":2}"#),
            Err(CanonError::DuplicateKey {
                key: "a".into(),
                offset: 7
            })
        );
        assert!(matches!(
            canon(r#"{"x":{"k":1,"k":1}}"#),
            Err(CanonError::DuplicateKey { .. })
        ));
        // The same key in different objects is fine.
        assert!(canon(r#"{"a":{"a":1},"b":{"a":2}}"#).is_ok());
    }

    #[test]
    fn invalid_utf8_is_refused_inside_and_outside_strings_id2() {
        assert_eq!(
            canonicalize(b"{\"a\":\"x\xff\"}"),
            Err(CanonError::InvalidUtf8 { offset: 7 })
        );
        // Truncated multi-byte sequence before the closing quote.
        assert_eq!(
            canonicalize(b"{\"a\":\"\xc3\"}"),
            Err(CanonError::InvalidUtf8 { offset: 6 })
        );
        // Surrogate code point encoded in UTF-8 (CESU) is not UTF-8.
        assert!(matches!(
            canonicalize(b"{\"\xed\xa0\x80\":1}"),
            Err(CanonError::InvalidUtf8 { .. })
        ));
        assert_eq!(
            canonicalize(b"{\"a\":\xff}"),
            Err(CanonError::InvalidUtf8 { offset: 5 })
        );
        assert_eq!(
            canonicalize(b"{\"a\":1}\xc0"),
            Err(CanonError::InvalidUtf8 { offset: 7 })
        );
    }

    #[test]
    fn lone_surrogate_escapes_are_refused_id2() {
        assert_eq!(
            canon(r#"{"a":"\ud800"}"#),
            Err(CanonError::LoneSurrogate { offset: 6 })
        );
        assert_eq!(
            canon(r#"{"a":"x\udc00y"}"#),
            Err(CanonError::LoneSurrogate { offset: 7 })
        );
        assert_eq!(
            canon(r#"{"a":"\ud83d\u0041"}"#),
            Err(CanonError::LoneSurrogate { offset: 6 })
        );
        assert_eq!(
            canon(r#"{"a":"\ud83d\ud83d"}"#),
            Err(CanonError::LoneSurrogate { offset: 6 })
        );
        assert_eq!(
            canon(r#"{"\ud83dx":1}"#),
            Err(CanonError::LoneSurrogate { offset: 2 })
        );
    }

    fn nested_objects(n: usize) -> String {
        format!("{}1{}", r#"{"a":"#.repeat(n), "}".repeat(n))
    }

    #[test]
    fn depth_128_accepted_and_129_refused_id2() {
        assert!(canon(&nested_objects(MAX_DEPTH)).is_ok());
        assert_eq!(
            canon(&nested_objects(MAX_DEPTH + 1)),
            Err(CanonError::TooDeep)
        );
        let arrays = |n: usize| format!("{{\"a\":{}{}}}", "[".repeat(n), "]".repeat(n));
        assert!(canon(&arrays(MAX_DEPTH - 1)).is_ok());
        assert_eq!(canon(&arrays(MAX_DEPTH)), Err(CanonError::TooDeep));
    }

    #[test]
    fn ten_thousand_levels_refused_without_stack_overflow_id2() {
        // A small stack proves the depth check bounds recursion.
        let run = std::thread::Builder::new()
            .stack_size(512 * 1024)
            .spawn(|| {
                let arrays = "[".repeat(10_000);
                let objects = nested_objects(10_000);
                let unclosed = r#"{"a":"#.repeat(10_000);
                (canon(&arrays), canon(&objects), canon(&unclosed))
            })
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(run.0, Err(CanonError::TooDeep));
        assert_eq!(run.1, Err(CanonError::TooDeep));
        assert_eq!(run.2, Err(CanonError::TooDeep));
    }

    #[test]
    fn non_object_top_level_is_refused_id2() {
        for body in [r#"[1,2]"#, r#""s""#, "12", "true", "null", " [] "] {
            assert_eq!(canon(body), Err(CanonError::NotObject), "{body:?}");
        }
        // A syntax error in a non-object still reports the syntax error.
        assert!(is_syntax(canon("[1,2")));
    }

    #[test]
    fn malformed_documents_are_syntax_errors_id2() {
        for body in [
            "",
            "   ",
            "{",
            "{\"a\":1",
            "{\"a\" 1}",
            "{\"a\":}",
            "{\"a\":1,}",
            "{a:1}",
            "{'a':1}",
            "{\"a\":[1,]}",
            "{\"a\":1}x",
            "{\"a\":1}{}",
            "{\"a\":1} \u{0}",
            "\u{0}{\"a\":1}",
            "{\"a\":tru}",
            "{\"a\":True}",
            "{\"a\":\"unterminated}",
            "{\"a\":\"\\x\"}",
            "{\"a\":\"\\u12\"}",
            "{\"a\":\"\\u12g4\"}",
            "{\"a\":1}\u{c}",
        ] {
            assert!(is_syntax(canon(body)), "{body:?} -> {:?}", canon(body));
        }
    }

    #[test]
    fn leading_bom_is_refused_id2() {
        assert_eq!(
            canonicalize(b"\xef\xbb\xbf{\"a\":1}"),
            Err(CanonError::Syntax {
                offset: 0,
                reason: "expected a JSON value"
            })
        );
    }

    #[test]
    fn raw_control_character_in_string_is_refused_id2() {
        for c in ['\u{0}', '\u{1}', '\n', '\t', '\u{1f}'] {
            let body = format!("{{\"a\":\"x{c}\"}}");
            assert_eq!(
                canon(&body),
                Err(CanonError::Syntax {
                    offset: 7,
                    reason: "raw control character in string"
                })
            );
        }
        // DEL is not a control character for JSON.
        assert!(canon("{\"a\":\"\u{7f}\"}").is_ok());
    }

    #[test]
    fn bad_numbers_are_refused_id2() {
        for n in [
            "01",
            "-01",
            "1.",
            ".5",
            "+1",
            "NaN",
            "Infinity",
            "-Infinity",
            "1e",
            "1e+",
            "-",
            "1.e5",
            "0x10",
            "1_000",
        ] {
            let body = format!("{{\"n\":{n}}}");
            assert!(is_syntax(canon(&body)), "{n} -> {:?}", canon(&body));
        }
    }

    // ---- model and stream (ID-3, ID-3b) ----

    #[test]
    fn model_span_covers_top_level_model_token_only_id3b() {
        let body = r#"{"meta":{"model":"inner"},"model" : "out\u0065r" ,"x":[{"model":"n"}]}"#;
        let c = canon(body).unwrap();
        let span = c.model_span.clone().unwrap();
        assert_eq!(&body[span], r#""out\u0065r""#);
        assert_eq!(c.model.as_deref(), Some("outer"));
    }

    #[test]
    fn non_string_or_missing_model_gives_no_span_id3b() {
        for body in [
            r#"{"model":5}"#,
            r#"{"m":{"model":"x"}}"#,
            r#"{"model":null}"#,
        ] {
            let c = canon(body).unwrap();
            assert_eq!(
                (c.model.clone(), c.model_span.clone()),
                (None, None),
                "{body}"
            );
            assert_eq!(c.with_model("other"), c.bytes);
        }
    }

    #[test]
    fn stream_is_true_only_for_top_level_literal_true_id3() {
        assert!(canon(r#"{"stream":true}"#).unwrap().stream);
        // Whether the client chose its stream's options, at the top level only.
        assert!(canon(r#"{"stream_options":null}"#).unwrap().stream_options);
        assert!(
            !canon(r#"{"x":{"stream_options":{}}}"#)
                .unwrap()
                .stream_options
        );
        assert!(!canon(r#"{"m":"stream_options"}"#).unwrap().stream_options);
        assert!(canon(r#"{ "stream" : true , "a":1}"#).unwrap().stream);
        assert!(canon(r#"{"\u0073tream":true}"#).unwrap().stream);
        for body in [
            r#"{"stream":"true"}"#,
            r#"{"stream":1}"#,
            r#"{"stream":false}"#,
            r#"{"stream":[true]}"#,
            r#"{"x":{"stream":true}}"#,
            r#"{"a":1}"#,
        ] {
            assert!(!canon(body).unwrap().stream, "{body}");
        }
    }

    #[test]
    fn rewrite_model_keeps_every_other_byte_id3b() {
        let body = br#"{ "b" : 1.0 ,"model":"x" }"#;
        let c = canonicalize(body).unwrap();
        let out = rewrite_model(body, c.model_span.clone().unwrap(), "gpt-4o-mini");
        assert_eq!(out, br#"{ "b" : 1.0 ,"model":"gpt-4o-mini" }"#);
    }

    #[test]
    fn rewritten_body_canonicalises_to_with_model_id3() {
        let body = br#"{"temperature":0.50, "model" : "alias", "messages":[{"role":"user","content":"hi"}],"stream":true}"#;
        let c = canonicalize(body).unwrap();
        for model in ["gpt-4o-mini", "we\"ird\\name", "ctl\u{1}", "é😀", ""] {
            let rewritten = rewrite_model(body, c.model_span.clone().unwrap(), model);
            let again = canonicalize(&rewritten).unwrap();
            assert_eq!(again.bytes, c.with_model(model), "{model:?}");
            assert_eq!(again.model.as_deref(), Some(model));
        }
    }

    #[test]
    fn a_path_model_is_part_of_the_hash_gm1() {
        let body = br#"{"contents":[]}"#;
        let a = request_hash_with_path_model("gemini.v1.generate", "g", &[], body, "m1");
        assert_ne!(
            a,
            request_hash_with_path_model("gemini.v1.generate", "g", &[], body, "m2")
        );
        assert_ne!(a, request_hash("gemini.v1.generate", "g", &[], body));
        assert_eq!(
            a,
            request_hash_with_path_model("gemini.v1.generate", "g", &[], body, "m1")
        );
    }

    #[test]
    fn rewritten_model_is_json_escaped_id3b() {
        let body = br#"{"model":"x"}"#;
        let c = canonicalize(body).unwrap();
        let out = rewrite_model(body, c.model_span.clone().unwrap(), "a\"b\\c");
        assert_eq!(out, br#"{"model":"a\"b\\c"}"#);
        assert_eq!(c.with_model("a\"b\\c"), br#"{"model":"a\"b\\c"}"#);
    }

    #[test]
    fn rewrite_model_with_bad_span_returns_body_unchanged_id3b() {
        let body = br#"{"model":"x"}"#;
        assert_eq!(rewrite_model(body, 10..40, "y"), body);
        assert_eq!(rewrite_model(body, 40..50, "y"), body);
    }

    #[test]
    fn aliases_rewritten_to_same_model_hash_alike_id3() {
        let a = canonicalize(br#"{"model":"fast","n":1}"#).unwrap();
        let b = canonicalize(br#"{"n":1,"model":"cheap"}"#).unwrap();
        let h = |c: &Canonical| request_hash("/r", "openai", &[], &c.with_model("gpt-4o-mini"));
        assert_eq!(h(&a), h(&b));
        assert_ne!(
            request_hash("/r", "openai", &[], &a.with_model("gpt-4o")),
            h(&a)
        );
    }

    // ---- request_hash (ID-3, ID-3a) ----

    #[test]
    fn request_hash_covers_every_field_id3() {
        let body = canon(r#"{"a":1}"#).unwrap().bytes;
        let other_body = canon(r#"{"a":2}"#).unwrap().bytes;
        let hdr = [("anthropic-version", "2023-06-01")];
        let base = request_hash("/v1/messages", "anthropic", &hdr, &body);
        assert_ne!(
            base,
            request_hash("/v1/messages2", "anthropic", &hdr, &body)
        );
        assert_ne!(
            base,
            request_hash("/v1/messages", "anthropic2", &hdr, &body)
        );
        assert_ne!(base, request_hash("/v1/messages", "anthropic", &[], &body));
        assert_ne!(
            base,
            request_hash(
                "/v1/messages",
                "anthropic",
                &[("anthropic-version", "2023-06-02")],
                &body
            )
        );
        assert_ne!(
            base,
            request_hash(
                "/v1/messages",
                "anthropic",
                &[("anthropic-beta", "2023-06-01")],
                &body
            )
        );
        assert_ne!(
            base,
            request_hash("/v1/messages", "anthropic", &hdr, &other_body)
        );
        assert_eq!(base, request_hash("/v1/messages", "anthropic", &hdr, &body));
    }

    #[test]
    fn header_name_case_and_order_do_not_matter_id3a() {
        let body = b"{}";
        let a = request_hash(
            "/r",
            "b",
            &[
                ("OpenAI-Beta", "assistants=v2"),
                ("openai-organization", "org"),
            ],
            body,
        );
        let b = request_hash(
            "/r",
            "b",
            &[
                ("OPENAI-ORGANIZATION", "org"),
                ("openai-beta", "assistants=v2"),
            ],
            body,
        );
        assert_eq!(a, b);
        // Values are taken as given.
        let c = request_hash(
            "/r",
            "b",
            &[
                ("openai-beta", "Assistants=v2"),
                ("openai-organization", "org"),
            ],
            body,
        );
        assert_ne!(a, c);
    }

    #[test]
    fn length_prefixes_separate_adjacent_fields_id3() {
        assert_ne!(
            request_hash("ab", "c", &[], b"{}"),
            request_hash("a", "bc", &[], b"{}")
        );
        assert_ne!(
            request_hash("r", "b", &[("ab", "c")], b"{}"),
            request_hash("r", "b", &[("a", "bc")], b"{}")
        );
        assert_ne!(
            request_hash("r", "", &[], b"{}"),
            request_hash("", "r", &[], b"{}")
        );
        assert_ne!(
            request_hash("r", "b", &[("x", "")], b"{}"),
            request_hash("r", "b", &[], b"{}")
        );
    }

    #[test]
    fn request_hash_is_sha256_of_documented_layout_id3() {
        let mut pre = Vec::new();
        for f in [CANONICAL_VERSION.as_bytes(), b"/r", b"be"] {
            pre.extend_from_slice(&(f.len() as u64).to_be_bytes());
            pre.extend_from_slice(f);
        }
        pre.extend_from_slice(&1u64.to_be_bytes());
        for f in [&b"openai-beta"[..], b"v", b"{}"] {
            pre.extend_from_slice(&(f.len() as u64).to_be_bytes());
            pre.extend_from_slice(f);
        }
        let expected: [u8; 32] = Sha256::digest(&pre).into();
        assert_eq!(
            request_hash("/r", "be", &[("OpenAI-Beta", "v")], b"{}"),
            expected
        );
        assert_eq!(hex::encode(expected).len(), 64);
    }

    // ---- properties ----

    /// A generated JSON value. Object keys are unique (decoded) and in no particular order.
    #[derive(Debug, Clone)]
    enum J {
        Null,
        Bool(bool),
        Num(String),
        Str(String),
        Arr(Vec<J>),
        Obj(Vec<(String, J)>),
    }

    fn any_char() -> impl Strategy<Value = char> {
        prop_oneof![
            6 => proptest::char::range('a', 'z'),
            1 => proptest::char::range('\u{0}', '\u{1f}'),
            1 => proptest::sample::select(vec!['"', '\\', '/', '\u{7f}', ' ']),
            1 => proptest::char::range('\u{80}', '\u{7ff}'),
            1 => proptest::char::range('\u{800}', '\u{d7ff}'),
            1 => proptest::char::range('\u{e000}', '\u{ffff}'),
            1 => proptest::char::range('\u{10000}', '\u{10ffff}'),
            1 => proptest::sample::select(vec!['€', 'ö', '\u{fb33}', '😀', '\u{2028}', '\u{80}']),
        ]
    }

    fn any_string() -> impl Strategy<Value = String> {
        proptest::collection::vec(any_char(), 0..8).prop_map(|v| v.into_iter().collect())
    }

    fn any_number() -> impl Strategy<Value = String> {
        proptest::string::string_regex(
            r"-?(0|[1-9][0-9]{0,20})(\.[0-9]{1,5})?([eE][+-]?[0-9]{1,3})?",
        )
        .unwrap()
    }

    fn any_object(inner: impl Strategy<Value = J>) -> impl Strategy<Value = J> {
        proptest::collection::btree_map(any_string(), inner, 0..6)
            .prop_map(|m| J::Obj(m.into_iter().collect()))
    }

    fn any_json() -> impl Strategy<Value = J> {
        let leaf = prop_oneof![
            Just(J::Null),
            any::<bool>().prop_map(J::Bool),
            any_number().prop_map(J::Num),
            any_string().prop_map(J::Str),
        ];
        let tree = leaf.prop_recursive(4, 48, 5, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..5).prop_map(J::Arr),
                any_object(inner),
            ]
        });
        // The top level is an object, so total nesting stays at most 5.
        any_object(tree)
    }

    /// SplitMix64: drives serialisation choices from one seed.
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

    /// Serialises `j` with shuffled keys, random whitespace and random escape choices.
    fn messy(j: &J, rng: &mut Rng, out: &mut String) {
        fn ws(rng: &mut Rng, out: &mut String) {
            for _ in 0..rng.below(3) {
                out.push([' ', '\t', '\n', '\r'][rng.below(4) as usize]);
            }
        }
        fn u_escape(rng: &mut Rng, c: char, out: &mut String) {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                if rng.below(2) == 0 {
                    out.push_str(&format!("\\u{u:04x}"));
                } else {
                    out.push_str(&format!("\\u{u:04X}"));
                }
            }
        }
        fn string(s: &str, rng: &mut Rng, out: &mut String) {
            out.push('"');
            for c in s.chars() {
                let escape = rng.below(4) == 0;
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
                if !must && !escape {
                    out.push(c);
                } else if let (Some(s), false) = (short, escape && rng.below(2) == 0) {
                    out.push_str(s);
                } else {
                    u_escape(rng, c, out);
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
                    messy(item, rng, out);
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
                    messy(&members[i].1, rng, out);
                    ws(rng, out);
                }
                out.push('}');
            }
        }
    }

    fn messy_string(j: &J, seed: u64) -> String {
        let mut out = String::new();
        let mut rng = Rng(seed);
        let mut pad = String::new();
        for _ in 0..rng.below(3) {
            pad.push(' ');
        }
        out.push_str(&pad);
        messy(j, &mut rng, &mut out);
        out.push_str(&pad);
        out
    }

    /// Reference canonical form, written independently of the parser: sorts with
    /// `encode_utf16` and escapes char by char.
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

    /// Number of mutable scalars in `j`.
    fn scalars(j: &J) -> usize {
        match j {
            J::Null | J::Bool(_) | J::Num(_) | J::Str(_) => 1,
            J::Arr(items) => items.iter().map(scalars).sum(),
            J::Obj(members) => members.iter().map(|(_, v)| scalars(v)).sum(),
        }
    }

    /// Changes the `k`-th scalar (in traversal order) to a different value or spelling.
    fn mutate(j: &mut J, k: &mut usize) -> bool {
        match j {
            J::Arr(items) => items.iter_mut().any(|v| mutate(v, k)),
            J::Obj(members) => members.iter_mut().any(|(_, v)| mutate(v, k)),
            _ if *k > 0 => {
                *k -= 1;
                false
            }
            J::Null => {
                *j = J::Bool(false);
                true
            }
            J::Bool(b) => {
                *b = !*b;
                true
            }
            J::Num(n) => {
                if n.contains('e') {
                    *n = n.replace('e', "E");
                } else if n.contains('E') {
                    *n = n.replace('E', "e");
                } else if n.contains('.') {
                    n.push('0');
                } else {
                    n.push_str(".0");
                }
                true
            }
            J::Str(s) => {
                let first = s.chars().next();
                let rest: String = s.chars().skip(1).collect();
                *s = match first {
                    None => "x".into(),
                    Some('a') => format!("b{rest}"),
                    Some(_) => format!("a{rest}"),
                };
                true
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn spellings_of_one_value_share_canonical_bytes_and_hash_id1_id3(
            j in any_json(), seed_a in any::<u64>(), seed_b in any::<u64>()
        ) {
            let a = messy_string(&j, seed_a);
            let b = messy_string(&j, seed_b);
            let ca = canonicalize(a.as_bytes()).map_err(|e| TestCaseError::fail(format!("{a:?}: {e}")))?;
            let cb = canonicalize(b.as_bytes()).map_err(|e| TestCaseError::fail(format!("{b:?}: {e}")))?;
            prop_assert_eq!(&ca.bytes, &cb.bytes);
            prop_assert_eq!(
                request_hash("/r", "be", &[("openai-beta", "x")], &ca.bytes),
                request_hash("/r", "be", &[("OpenAI-Beta", "x")], &cb.bytes)
            );
            let mut expected = String::new();
            reference(&j, &mut expected);
            prop_assert_eq!(String::from_utf8_lossy(&ca.bytes), expected);
            // Canonical bytes are a fixed point.
            prop_assert_eq!(&canonicalize(&ca.bytes).unwrap().bytes, &ca.bytes);
            // And they mean the same as the input, where serde_json can represent the numbers.
            if let (Ok(x), Ok(y)) = (
                serde_json::from_slice::<serde_json::Value>(a.as_bytes()),
                serde_json::from_slice::<serde_json::Value>(&ca.bytes),
            ) {
                prop_assert_eq!(x, y);
            }
        }

        #[test]
        fn changing_one_scalar_changes_the_hash_id1_id3(
            j in any_json(), pick in any::<usize>(), seed_a in any::<u64>(), seed_b in any::<u64>()
        ) {
            let n = scalars(&j);
            prop_assume!(n > 0);
            let mut changed = j.clone();
            prop_assert!(mutate(&mut changed, &mut (pick % n)));
            let a = canonicalize(messy_string(&j, seed_a).as_bytes()).unwrap();
            let b = canonicalize(messy_string(&changed, seed_b).as_bytes()).unwrap();
            prop_assert_ne!(
                request_hash("/r", "be", &[], &a.bytes),
                request_hash("/r", "be", &[], &b.bytes)
            );
        }

        #[test]
        fn utf16_key_order_matches_encode_utf16_id1(a in any_string(), b in any_string()) {
            prop_assert_eq!(
                cmp_utf16(a.as_bytes(), b.as_bytes()),
                a.encode_utf16().cmp(b.encode_utf16())
            );
        }

        #[test]
        fn arbitrary_bytes_never_panic_id2(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = canonicalize(&bytes);
        }

        #[test]
        fn model_rewrite_round_trips_id3b(
            j in any_json(), model in any_string(), seed in any::<u64>(), alias in any_string()
        ) {
            let J::Obj(mut members) = j else { unreachable!() };
            members.retain(|(k, _)| k != "model");
            members.push(("model".into(), J::Str(alias)));
            let body = messy_string(&J::Obj(members), seed);
            let c = canonicalize(body.as_bytes()).unwrap();
            let span = c.model_span.clone().unwrap();
            let rewritten = rewrite_model(body.as_bytes(), span.clone(), &model);
            prop_assert_eq!(&rewritten[..span.start], &body.as_bytes()[..span.start]);
            prop_assert_eq!(&rewritten[rewritten.len() - (body.len() - span.end)..], &body.as_bytes()[span.end..]);
            let again = canonicalize(&rewritten).unwrap();
            prop_assert_eq!(again.bytes, c.with_model(&model));
            prop_assert_eq!(again.model, Some(model));
        }
    }
}
