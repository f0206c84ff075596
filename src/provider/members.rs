//! The top-level members of a JSON object, found in one pass over its text that also checks
//! the whole text is JSON: the probe of every stream event and the check of every 2xx answer
//! (`events.rs`, LC-7, LC-11).
//!
//! serde_json read each event's data into a struct before: the members the rules read as raw
//! JSON, the rest skipped. That was about 3.4 k instructions of a proxied chat event's 24.5 k;
//! with this pass the whole probe takes about 1.9 k (docs/benchmarks.md, lever 15). It accepts
//! exactly what serde_json's skipping of a value accepts (RFC 8259: `"\u"` escapes need four hex
//! digits and nothing more, no control character inside a string, numbers by the grammar
//! however large). What it does not decide it leaves to serde_json by returning `None`: a key
//! with an escape, nesting deeper than [`MAX_DEPTH`], or what the caller's `member` refuses.
//! Tests compare it with serde_json on generated and mutated texts.

/// How deep a value may nest before [`object`] leaves the text to serde_json: the depth fits
/// in one 128-bit stack of object-or-array bits.
const MAX_DEPTH: u32 = 128;

/// Walks the JSON object `text` (whitespace around it allowed), calling `member(key, value)`
/// for each top-level member in order: the key without its quotes, the value's JSON text
/// without surrounding whitespace. `None` when `text` is not one JSON object or is left to
/// serde_json (a key with an escape, too deep), or when `member` returns `false`.
pub(super) fn object<'a>(
    text: &'a str,
    mut member: impl FnMut(&'a str, &'a str) -> bool,
) -> Option<()> {
    let mut scan = Scan {
        text: text.as_bytes(),
        at: 0,
    };
    scan.whitespace();
    scan.eat(b'{')?;
    scan.whitespace();
    if scan.eat(b'}').is_none() {
        loop {
            scan.eat(b'"')?;
            let start = scan.at;
            if scan.string()? {
                return None;
            }
            let key = text.get(start..scan.at - 1)?;
            scan.whitespace();
            scan.eat(b':')?;
            scan.whitespace();
            let start = scan.at;
            scan.value()?;
            if !member(key, text.get(start..scan.at)?) {
                return None;
            }
            scan.whitespace();
            match scan.next()? {
                b',' => scan.whitespace(),
                b'}' => break,
                _ => return None,
            }
        }
    }
    scan.whitespace();
    (scan.at == scan.text.len()).then_some(())
}

/// The bytes of `word` (eight, little-endian) that end a string's plain run: a quote, a
/// backslash or a control character, each marked by its high bit. The lowest mark is always
/// the first such byte; a borrow may mark bytes after it too, never before.
fn stops(word: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    let zero = |x: u64| x.wrapping_sub(ONES) & !x;
    let quote = zero(word ^ (ONES * u64::from(b'"')));
    let backslash = zero(word ^ (ONES * u64::from(b'\\')));
    let control = word.wrapping_sub(ONES * 0x20) & !word;
    (quote | backslash | control) & (ONES * 0x80)
}

/// A position in a JSON text.
struct Scan<'a> {
    text: &'a [u8],
    at: usize,
}

/// Every step is inlined into [`object`]: the position then stays in a register, which took
/// the probe of a chat event from about 2.5 k instructions to 1.9 k (docs/benchmarks-history.md,
/// twenty-fifth session; lever 15).
impl Scan<'_> {
    /// The next byte, consumed.
    #[inline(always)]
    fn next(&mut self) -> Option<u8> {
        let byte = *self.text.get(self.at)?;
        self.at += 1;
        Some(byte)
    }

    /// Consumes `byte` if it is next.
    #[inline(always)]
    fn eat(&mut self, byte: u8) -> Option<()> {
        (self.text.get(self.at) == Some(&byte)).then(|| self.at += 1)
    }

    /// Skips JSON whitespace: space, tab, line feed, carriage return.
    #[inline(always)]
    fn whitespace(&mut self) {
        while let Some(&byte) = self.text.get(self.at)
            && byte <= b' '
            && matches!(byte, b' ' | b'\t' | b'\n' | b'\r')
        {
            self.at += 1;
        }
    }

    /// Skips the rest of a string whose opening quote is consumed, through its closing one;
    /// whether it held an escape. `None` at a bad escape, a control character or the end.
    /// Eight bytes are looked at together ([`stops`]) where eight remain.
    #[inline(always)]
    fn string(&mut self) -> Option<bool> {
        let mut escaped = false;
        loop {
            while let Some(&word) = self.text.get(self.at..).and_then(|rest| rest.first_chunk()) {
                let found = stops(u64::from_le_bytes(word));
                if found != 0 {
                    self.at += (found.trailing_zeros() / 8) as usize;
                    break;
                }
                self.at += 8;
            }
            match self.next()? {
                b'"' => return Some(escaped),
                b'\\' => {
                    escaped = true;
                    match self.next()? {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {}
                        b'u' => {
                            for _ in 0..4 {
                                self.next().filter(u8::is_ascii_hexdigit)?;
                            }
                        }
                        _ => return None,
                    }
                }
                0..0x20 => return None,
                _ => {}
            }
        }
    }

    /// Skips digits; how many.
    #[inline(always)]
    fn digits(&mut self) -> usize {
        let start = self.at;
        while self.text.get(self.at).is_some_and(u8::is_ascii_digit) {
            self.at += 1;
        }
        self.at - start
    }

    /// Skips a number: `-`? (`0` | a digit from 1 with more) (`.` digits)? (`e` sign? digits)?
    #[inline(always)]
    fn number(&mut self) -> Option<()> {
        let _ = self.eat(b'-');
        match self.next()? {
            b'0' => {}
            b'1'..=b'9' => {
                self.digits();
            }
            _ => return None,
        }
        if self.eat(b'.').is_some() && self.digits() == 0 {
            return None;
        }
        if let Some(b'e' | b'E') = self.text.get(self.at) {
            self.at += 1;
            if let Some(b'+' | b'-') = self.text.get(self.at) {
                self.at += 1;
            }
            if self.digits() == 0 {
                return None;
            }
        }
        // `01` is no number: serde_json refuses a digit after a leading zero, as this does
        // by what may follow a value.
        Some(())
    }

    /// Skips `word` (the rest of `true`, `false` or `null`).
    #[inline(always)]
    fn word(&mut self, word: &[u8]) -> Option<()> {
        let end = self.at + word.len();
        (self.text.get(self.at..end) == Some(word)).then(|| self.at = end)
    }

    /// Skips one value, nested ones with it, without recursion: `depth` bits say, innermost
    /// lowest, whether each open container is an object.
    #[inline(always)]
    fn value(&mut self) -> Option<()> {
        let (mut stack, mut depth) = (0u128, 0u32);
        loop {
            // A value starts here.
            let mut opened = None;
            match self.next()? {
                b'"' => {
                    self.string()?;
                }
                b'{' => opened = Some(true),
                b'[' => opened = Some(false),
                b't' => self.word(b"rue")?,
                b'f' => self.word(b"alse")?,
                b'n' => self.word(b"ull")?,
                b'-' | b'0'..=b'9' => {
                    self.at -= 1;
                    self.number()?;
                }
                _ => return None,
            }
            if let Some(is_object) = opened {
                if depth == MAX_DEPTH {
                    return None;
                }
                stack = stack << 1 | u128::from(is_object);
                depth += 1;
                self.whitespace();
                let close = if is_object { b'}' } else { b']' };
                if self.eat(close).is_some() {
                    stack >>= 1;
                    depth -= 1;
                } else {
                    if is_object {
                        self.key()?;
                    }
                    continue;
                }
            }
            // A value ended: close what ends with it, then find the next value, if any.
            loop {
                if depth == 0 {
                    return Some(());
                }
                let in_object = stack & 1 == 1;
                self.whitespace();
                match self.next()? {
                    b',' => {
                        self.whitespace();
                        if in_object {
                            self.key()?;
                        }
                        break;
                    }
                    b'}' if in_object => {}
                    b']' if !in_object => {}
                    _ => return None,
                }
                stack >>= 1;
                depth -= 1;
            }
        }
    }

    /// Skips a member's key and its colon, and the whitespace after both.
    #[inline(always)]
    fn key(&mut self) -> Option<()> {
        self.eat(b'"')?;
        self.string()?;
        self.whitespace();
        self.eat(b':')?;
        self.whitespace();
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The members [`object`] finds, or `None`.
    fn members(text: &str) -> Option<Vec<(String, String)>> {
        let mut found = Vec::new();
        object(text, |key, value| {
            found.push((key.to_owned(), value.to_owned()));
            true
        })
        .map(|()| found)
    }

    /// What serde_json finds: each member's key and raw value, when `text` is an object.
    fn serde_members(text: &str) -> Option<Vec<(String, String)>> {
        struct Members(Vec<(String, String)>);
        impl<'de> serde::Deserialize<'de> for Members {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct Visit;
                impl<'de> serde::de::Visitor<'de> for Visit {
                    type Value = Members;
                    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                        f.write_str("an object")
                    }
                    fn visit_map<A: serde::de::MapAccess<'de>>(
                        self,
                        mut map: A,
                    ) -> Result<Members, A::Error> {
                        let mut found = Vec::new();
                        while let Some((key, value)) =
                            map.next_entry::<String, &serde_json::value::RawValue>()?
                        {
                            found.push((key, value.get().to_owned()));
                        }
                        Ok(Members(found))
                    }
                }
                d.deserialize_map(Visit)
            }
        }
        serde_json::from_str::<Members>(text).ok().map(|m| m.0)
    }

    /// Whether serde_json reads `text` as JSON at all, the way the event probe's fields skip a
    /// value (no depth limit, numbers by their grammar).
    fn serde_accepts(text: &str) -> bool {
        serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok()
    }

    #[test]
    fn finds_each_top_level_member_as_its_raw_json_lc11() {
        assert_eq!(
            members(r#" { "a" : [1, {"b": "c"}] , "d":null,"e":"\u00e9\n" } "#),
            Some(vec![
                ("a".into(), r#"[1, {"b": "c"}]"#.into()),
                ("d".into(), "null".into()),
                ("e".into(), r#""\u00e9\n""#.into()),
            ])
        );
        assert_eq!(members("{}"), Some(vec![]));
        assert_eq!(
            members("{\"a\":-0.5e+7}"),
            Some(vec![("a".into(), "-0.5e+7".into())])
        );
    }

    #[test]
    fn refuses_what_is_not_one_json_object_lc11() {
        for text in [
            "",
            "[]",
            "1",
            "\"a\"",
            "{",
            "{\"a\"}",
            "{\"a\":}",
            "{\"a\":1,}",
            "{,}",
            "{\"a\":1}x",
            "{\"a\":01}",
            "{\"a\":1.}",
            "{\"a\":.5}",
            "{\"a\":1e}",
            "{\"a\":-}",
            "{\"a\":tru}",
            "{\"a\":[1,]}",
            "{\"a\":[1 2]}",
            "{\"a\":{\"b\"}}",
            "{\"a\":\"\\x\"}",
            "{\"a\":\"\\u12g4\"}",
            "{\"a\":\"\t\"}",
            "{\"a\":[}",
            "{\"a\":{]}",
            "{'a':1}",
            "{\"a\":1}{}",
            "\u{feff}{}",
        ] {
            assert_eq!(members(text), None, "{text:?}");
            assert_eq!(serde_members(text), None, "serde_json agrees on {text:?}");
        }
    }

    #[test]
    fn the_first_quote_backslash_or_control_byte_of_eight_is_found_exactly_lc11() {
        for byte in 0..=u8::MAX {
            let stop = byte == b'"' || byte == b'\\' || byte < 0x20;
            for at in 0..8 {
                for before in [b'a', 0xff, 0x20, 0x7f] {
                    let mut word = [b'a'; 8];
                    word[..at].fill(before);
                    word[at] = byte;
                    // Every byte after the first stop may be marked; none before it.
                    word[at + 1..].fill(0x01);
                    let found = stops(u64::from_le_bytes(word));
                    let first = (found != 0).then(|| found.trailing_zeros() / 8);
                    let expected = if stop {
                        Some(at as u32)
                    } else {
                        (at < 7).then_some(at as u32 + 1)
                    };
                    assert_eq!(first, expected, "{word:?}");
                }
            }
        }
    }

    #[test]
    fn leaves_escaped_keys_and_deep_nesting_to_serde_json_lc11() {
        assert_eq!(members(r#"{"ch\u006fices":[]}"#), None);
        let deep = format!("{{\"a\":{}{}}}", "[".repeat(129), "]".repeat(129));
        assert_eq!(members(&deep), None);
        assert!(serde_accepts(&deep[5..deep.len() - 1]));
        let shallow = format!("{{\"a\":{}{}}}", "[".repeat(128), "]".repeat(128));
        assert_eq!(members(&shallow).map(|m| m.len()), Some(1));
    }

    /// Cases per property: `PROPTEST_CASES` (the long form of docs/reliability.md, "Parser
    /// fuzzing"), else 2,000.
    fn cases() -> u32 {
        std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|cases| cases.parse().ok())
            .unwrap_or(2000)
    }

    /// Any JSON value, as text, with whitespace and escapes where JSON allows them.
    fn json() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_owned()),
            Just("true".to_owned()),
            Just("false".to_owned()),
            any::<i64>().prop_map(|n| n.to_string()),
            any::<f64>().prop_map(|n| serde_json::to_string(&n).unwrap_or_default()),
            "-?(0|[1-9][0-9]{0,25})(\\.[0-9]{1,5})?([eE][+-]?[0-9]{1,4})?",
            "\"([a-z \u{e9}\u{1f600}]|\\\\[\"\\\\/bfnrt]|\\\\u[0-9a-fA-F]{4}){0,8}\"",
        ];
        leaf.prop_recursive(5, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5)
                    .prop_map(|items| format!("[{}]", items.join(" , "))),
                prop::collection::vec(("[a-z]{0,3}", inner), 0..5).prop_map(|members| {
                    let members: Vec<String> = members
                        .iter()
                        .map(|(k, v)| format!("\"{k}\":\n{v}"))
                        .collect();
                    format!("{{ {} }}", members.join(","))
                }),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        #[test]
        fn agrees_with_serde_json_on_json_objects_lc11(
            members_ in prop::collection::vec(("[a-z]{0,4}", json()), 0..6)
        ) {
            let text: Vec<String> = members_.iter().map(|(k, v)| format!("\"{k}\" : {v}")).collect();
            let text = format!(" {{{}}}\n", text.join(",\t"));
            prop_assert_eq!(members(&text), serde_members(&text));
            prop_assert!(members(&text).is_some());
        }

        #[test]
        fn agrees_with_serde_json_on_mutated_json_lc11(
            value in json(),
            at in any::<prop::sample::Index>(),
            cut in 0usize..3,
            insert in prop::sample::select(vec!["", "\"", "\\", ",", ":", "}", "]", "{", "[", "0", "-", ".", "e", " ", "\u{1}", "n", "\\u00", "x"]),
        ) {
            let text = format!("{{\"k\":{value}}}");
            // Cut `cut` bytes at a character boundary and put `insert` there.
            let mut at = at.index(text.len() + 1);
            while !text.is_char_boundary(at) { at -= 1; }
            let mut end = (at + cut).min(text.len());
            while !text.is_char_boundary(end) { end += 1; }
            let mutated = format!("{}{}{}", &text[..at], insert, &text[end..]);
            let found = members(&mutated);
            let expected = serde_members(&mutated);
            match (&found, &expected) {
                // An escaped key is left to serde_json.
                (None, Some(m)) => prop_assert!(
                    mutated.contains('\\') && m.iter().any(|(k, _)| !mutated.contains(&format!("\"{k}\""))),
                    "refused {:?}, which serde_json reads as {:?}", mutated, m
                ),
                _ => prop_assert_eq!(found, expected, "{:?}", mutated),
            }
        }
    }
}
