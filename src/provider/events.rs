//! How a provider answer is read, for every provider: each stream event checked before it is
//! stored (JSON, error or not, final or finishing, its usage and answer id; LC-7, LC-11,
//! decisions 42, 44, GM-3), and a whole 2xx body checked for the route's result member (LC-11,
//! decision 39). The worker asks these and never spells a provider's member or event itself.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde_json::value::RawValue;

use super::{BodyParts, EventParts, Json, Route, Usage, members};

/// What [`Route::inspect_event`] found in one provider event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Seen {
    /// The event reports an error (LC-7).
    pub error: bool,
    /// The event completes the route's stream ([`Route::ends_stream`]): reading stops here.
    pub ends_stream: bool,
    /// The event finishes the answer ([`Route::answer_marks`]): the stream is complete if
    /// the body then ends cleanly (Gemini, GM-3).
    pub finishes_answer: bool,
    /// The event reports the answer's usage and nothing else ([`Route::is_usage_report`]): the
    /// stream is complete if the body ends cleanly right after it (Gemini, GM-3).
    pub usage_alone: bool,
    /// The event shows part of the answer ([`Route::answer_marks`]): after it, a usage report
    /// no longer ends the stream, only a finishing event does (Gemini, GM-3, decision 119).
    pub shows_answer: bool,
    /// The candidates the event finishes and leaves open ([`Route::answer_marks`]): a stream
    /// is complete only when none is left open (Gemini, GM-3, decision 142).
    pub candidates: super::gemini::Candidates,
    /// The event is the one the route's stream opens with ([`Route::stream_start_name`]).
    pub starts_stream: bool,
    /// The event says how the answer ended ([`Route::stream_result_name`]).
    pub gives_result: bool,
    /// The event only keeps the stream open ([`Route::is_keepalive_event`]).
    pub keepalive: bool,
    /// The provider's id of the answer, when the event announces it
    /// ([`Route::answer_id_of_event`]).
    pub answer_id: Option<String>,
    /// What the event reports the attempt has cost ([`Route::usage_of_event`]).
    pub usage: Option<Usage>,
}

/// What a stream has shown of its order so far, for [`Route::in_order`].
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Order {
    /// The route's opening event has come (decision 44).
    opened: bool,
    /// The event saying how the answer ended has come (decision 108).
    resulted: bool,
}

/// The members of an event's data the provider rules read: whether `error` and `choices` are
/// there, the rest as their JSON text, borrowed. A member that is `null` counts as absent.
#[derive(Debug, Default, PartialEq, Eq)]
struct EventProbe<'a> {
    error: bool,
    kind: Option<Cow<'a, str>>,
    response: Option<&'a str>,
    message: Option<&'a str>,
    usage: Option<&'a str>,
    choices: bool,
    candidates: Option<&'a str>,
    prompt_feedback: Option<&'a str>,
    usage_metadata: Option<&'a str>,
}

/// The members [`EventProbe::scan`] reads, each its bit in the set of those seen (at most 16).
#[derive(Clone, Copy)]
enum Probed {
    Error,
    Type,
    Response,
    Message,
    Usage,
    Choices,
    Candidates,
    PromptFeedback,
    UsageMetadata,
}

impl Probed {
    /// The probed member whose key is `key`, spelled as the providers spell it.
    fn named(key: &str) -> Option<Probed> {
        Some(match key {
            "error" => Probed::Error,
            "type" => Probed::Type,
            "response" => Probed::Response,
            "message" => Probed::Message,
            "usage" => Probed::Usage,
            "choices" => Probed::Choices,
            "candidates" => Probed::Candidates,
            "promptFeedback" => Probed::PromptFeedback,
            "usageMetadata" => Probed::UsageMetadata,
            _ => return None,
        })
    }
}

/// [`EventProbe`] as serde_json reads it, for what [`members::object`] leaves to it.
/// `Option<&RawValue>` reads a JSON `null` as absent.
#[derive(serde::Deserialize, Default)]
struct SerdeProbe<'a> {
    #[serde(borrow)]
    error: Option<&'a RawValue>,
    #[serde(borrow, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow)]
    response: Option<&'a RawValue>,
    #[serde(borrow)]
    message: Option<&'a RawValue>,
    #[serde(borrow)]
    usage: Option<&'a RawValue>,
    #[serde(borrow)]
    choices: Option<&'a RawValue>,
    #[serde(borrow)]
    candidates: Option<&'a RawValue>,
    #[serde(borrow, rename = "promptFeedback")]
    prompt_feedback: Option<&'a RawValue>,
    #[serde(borrow, rename = "usageMetadata")]
    usage_metadata: Option<&'a RawValue>,
}

impl<'a> EventProbe<'a> {
    /// Reads `data`: in one pass ([`members::object`]) when it can, else as serde_json reads
    /// it ([`probe`], which also gives a key twice its last value). `Err` when `data` is not
    /// JSON; JSON that is not an object has none of the members.
    fn read(data: &'a str, normalised: &'a mut String) -> Result<EventProbe<'a>, ()> {
        // Only data that opens with its object: serde_json reads any other (whitespace first)
        // as a whole `Value`, which refuses more than skipping does (a lone surrogate, a
        // number past `f64`, nesting past 128).
        if data.starts_with('{')
            && let Some(probe) = EventProbe::scan(data)
        {
            return Ok(probe);
        }
        EventProbe::serde(data, normalised)
    }

    /// Reads `data` as serde_json does ([`probe`]).
    fn serde(data: &'a str, normalised: &'a mut String) -> Result<EventProbe<'a>, ()> {
        let probe = probe::<SerdeProbe<'a>>(data, normalised)?;
        Ok(EventProbe {
            error: probe.error.is_some(),
            kind: probe.kind,
            response: probe.response.map(RawValue::get),
            message: probe.message.map(RawValue::get),
            usage: probe.usage.map(RawValue::get),
            choices: probe.choices.is_some(),
            candidates: probe.candidates.map(RawValue::get),
            prompt_feedback: probe.prompt_feedback.map(RawValue::get),
            usage_metadata: probe.usage_metadata.map(RawValue::get),
        })
    }

    /// Reads an object `data` in one pass; `None` leaves it to serde_json: not an object, not
    /// JSON, nesting past 128, or a probed member twice, a `type` that is not a plain string,
    /// an escaped key.
    fn scan(data: &'a str) -> Option<EventProbe<'a>> {
        let mut probe = EventProbe::default();
        let mut seen = 0u16;
        members::object(data, |key, value| {
            let Some(member) = Probed::named(key) else {
                return true;
            };
            let bit = 1 << member as u16;
            if seen & bit != 0 {
                return false;
            }
            seen |= bit;
            if value == "null" {
                return true;
            }
            match member {
                Probed::Error => probe.error = true,
                Probed::Type => match value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
                    Some(kind) if !kind.contains('\\') => probe.kind = Some(Cow::Borrowed(kind)),
                    _ => return false,
                },
                Probed::Response => probe.response = Some(value),
                Probed::Message => probe.message = Some(value),
                Probed::Usage => probe.usage = Some(value),
                Probed::Choices => probe.choices = true,
                Probed::Candidates => probe.candidates = Some(value),
                Probed::PromptFeedback => probe.prompt_feedback = Some(value),
                Probed::UsageMetadata => probe.usage_metadata = Some(value),
            }
            true
        })?;
        Some(probe)
    }

    /// Whether the top-level member `name` (one of the probed ones) is there.
    fn has(&self, name: &str) -> bool {
        match name {
            "choices" => self.choices,
            "candidates" => self.candidates.is_some(),
            "promptFeedback" => self.prompt_feedback.is_some(),
            "usageMetadata" => self.usage_metadata.is_some(),
            _ => false,
        }
    }
}

/// Parses `data` as JSON into `T`, borrowing. An object `T` cannot read directly (a key twice:
/// `serde_json::Value` keeps the last, as every SDK does) is read from its re-serialisation,
/// kept in `normalised`; JSON that is not an object gives `T::default()`. `Err` when `data` is
/// not JSON.
fn probe<'a, T>(data: &'a str, normalised: &'a mut String) -> Result<T, ()>
where
    T: serde::Deserialize<'a> + Default,
{
    if data.starts_with('{')
        && let Ok(probe) = serde_json::from_str::<T>(data)
    {
        return Ok(probe);
    }
    match serde_json::from_str::<serde_json::Value>(data) {
        Ok(value @ serde_json::Value::Object(_)) => {
            *normalised = value.to_string();
            Ok(serde_json::from_str(normalised).unwrap_or_default())
        }
        Ok(_) => Ok(T::default()),
        Err(_) => Err(()),
    }
}

/// The top-level members of a whole answer, each as its JSON text, in order.
/// What [`Route::check_answer`] reads of an answer: the provider's id of it, the usage it
/// reports, and why it is the provider's report of a failure (LC-7a).
pub(crate) type Answered = (Option<String>, Option<Usage>, Option<String>);

struct BodyMembers<'a>(Vec<(Cow<'a, str>, &'a str)>);

impl<'a> BodyMembers<'a> {
    /// Reads `body`: in one pass ([`members::object`]) when it can, else as serde_json reads it
    /// (an escaped key, or a body that is not one object, which `Err` names).
    fn read(body: &'a [u8]) -> Result<BodyMembers<'a>, &'static str> {
        if let Ok(text) = std::str::from_utf8(body) {
            let mut found = Vec::with_capacity(8);
            let scanned = members::object(text, |key, value| {
                found.push((Cow::Borrowed(key), value));
                true
            });
            if scanned.is_some() {
                return Ok(BodyMembers(found));
            }
        }
        match serde_json::from_slice::<BTreeMap<Cow<'_, str>, &RawValue>>(body) {
            Ok(members) => Ok(BodyMembers(
                members.into_iter().map(|(k, v)| (k, v.get())).collect(),
            )),
            Err(_) if serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok() => {
                Err("JSON that is not an object")
            }
            Err(_) => Err("a body that is not JSON"),
        }
    }

    /// Member `name`'s JSON text, unless it is absent or `null`. A key twice keeps the last,
    /// as every SDK does.
    fn get(&self, name: &str) -> Option<&'a str> {
        let (_, value) = self.0.iter().rev().find(|(key, _)| key == name)?;
        Some(*value).filter(|value| *value != "null")
    }
}

impl Route {
    /// Checks a provider event (`name`: its `event:` name; `data`) before it is stored: its data
    /// must be JSON or `[DONE]` (otherwise `Err` with the reason), and carry one of the route's
    /// [`Route::stream_event_members`] unless it is an error. Says whether it reports an error,
    /// ends or finishes the stream, opens it, only keeps it open, and what it reports.
    ///
    /// One pass per event: an object's top-level members are found while the whole text is
    /// validated ([`members::object`]), the ones the rules read kept as their JSON text and
    /// nothing allocated. Only what that pass leaves (data that does not open with `{`, a
    /// probed key twice, an escaped key, a `type` that is no plain string, nesting past 128)
    /// takes serde_json's path.
    pub(crate) fn inspect_event(self, name: Option<&str>, data: &str) -> Result<Seen, String> {
        let provider = self.provider();
        if data == "[DONE]" {
            return Ok(Seen {
                error: provider.is_error_event(name, None, false),
                ends_stream: self.ends_stream(data, name),
                ..Seen::default()
            });
        }
        let mut normalised = String::new();
        let Ok(probe) = EventProbe::read(data, &mut normalised) else {
            return Err(format!(
                "the provider sent an event whose data is not JSON: {}",
                excerpt(data.as_bytes())
            ));
        };
        let parts = EventParts {
            kind: name.or(probe.kind.as_deref()),
            response: probe.response,
            message: probe.message,
            usage: probe.usage,
            candidates: probe.candidates,
            prompt_feedback: probe.prompt_feedback,
            usage_metadata: probe.usage_metadata,
        };
        let error = provider.is_error_event(name, parts.kind, probe.error);
        let members = self.stream_event_members();
        if !error && !members.is_empty() && !members.iter().any(|m| probe.has(m)) {
            // Not a chunk of this route's answer: no SDK can read it (decision 42, GM-3).
            return Err(format!(
                "the provider sent a stream event without {}: {}",
                named(members, "or"),
                excerpt(data.as_bytes())
            ));
        }
        let marks = if error {
            super::gemini::AnswerMarks::default()
        } else {
            self.answer_marks(&parts)
        };
        Ok(Seen {
            error,
            ends_stream: self.ends_stream(data, parts.kind),
            finishes_answer: marks.finishes,
            usage_alone: !error && self.is_usage_report(&parts),
            shows_answer: marks.shows,
            candidates: marks.candidates,
            starts_stream: parts.kind.is_some() && parts.kind == self.stream_start_name(),
            gives_result: parts.kind.is_some() && parts.kind == self.stream_result_name(),
            keepalive: self.is_keepalive_event(parts.kind),
            answer_id: self.answer_id_of_event(&parts),
            usage: self.usage_of_event(&parts),
        })
    }

    /// Checks that an event (`seen`, its `data`) keeps the order of the route's stream, as far
    /// as `order` (what came before it) tells: `Err` with the reason when it is a second
    /// opening event ([`Route::stream_start_name`]), or comes before the first and is neither
    /// a keep-alive nor an error (decision 44), or is the final event of a stream that has an
    /// event saying how the answer ended ([`Route::stream_result_name`]) and has not sent it
    /// (decision 108).
    pub(crate) fn in_order(self, seen: &Seen, order: &mut Order, data: &str) -> Result<(), String> {
        if let Some(start) = self.stream_start_name() {
            let why = if seen.starts_stream {
                std::mem::replace(&mut order.opened, true).then_some("sent a second")
            } else if order.opened || seen.keepalive || seen.error {
                None
            } else {
                Some("began with an event other than")
            };
            if let Some(why) = why {
                return Err(format!(
                    "the provider stream {why} `{start}`: {}",
                    excerpt(data.as_bytes())
                ));
            }
        }
        // An error event says how the stream ended too: what follows it is judged as before.
        order.resulted |= seen.gives_result || seen.error;
        if let Some(result) = self.stream_result_name()
            && seen.ends_stream
            && !order.resulted
        {
            return Err(format!(
                "the provider stream sent `{}` before any `{result}`, which says why the answer \
                 stopped and what it cost: {}",
                self.stream_end_name(),
                excerpt(data.as_bytes())
            ));
        }
        Ok(())
    }

    /// Checks a 2xx non-stream answer (LC-11): it must be one JSON object, and not an error
    /// object (a non-null top-level `error` with none of the route's [`Route::result_members`]).
    /// `Err` says what it is instead; `Ok` carries the provider's id of the answer, if it has
    /// one, the usage it reports, and why the answer is the provider's own report of a failure
    /// (LC-7a: a Responses object whose `status` is `failed`, its `error` saying why), `None`
    /// for every other answer: read in the same pass over the body.
    pub(crate) fn check_answer(self, body: &[u8]) -> Result<Answered, String> {
        let members = BodyMembers::read(body).map_err(String::from)?;
        let member = |name: &str| members.get(name);
        let text = |name: &str| member(name).and_then(|v| serde_json::from_str::<String>(v).ok());
        let (id, object) = (text("id"), text("object"));
        let answered = |m: &&str| match member(m) {
            // A usage report alone is an answer only as one (decision 90): counts, and no
            // error beside them; `{"error":…,"usageMetadata":…}` or `{"usageMetadata":{}}`
            // is not what the model answered.
            Some(v) if *m == "usageMetadata" => {
                member("error").is_none()
                    && serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(v)
                        .is_ok_and(|counts| !counts.is_empty())
            }
            found => found.is_some(),
        };
        let results = self.result_members();
        for &(name, json) in results {
            // Nor one whose result member it reads as another type: a Messages `content`
            // that is a string is no array of blocks (decision 107).
            if let Some(value) = member(name)
                && Json::of(value) != Some(json)
            {
                return Err(format!(
                    "a JSON object whose `{name}` is {}, not the {} every answer of this route has",
                    type_named(value),
                    json.name()
                ));
            }
        }
        if self.empty_result_answers_nothing()
            && let Some(&(name, _)) = results.first()
            && member(name).is_some_and(|v| v[1..].trim_start().starts_with(']'))
        {
            return Err(format!(
                "a JSON object whose `{name}` is empty: it answered nothing (decision 143)"
            ));
        }
        if !results.iter().map(|(name, _)| name).any(answered) {
            // No SDK can read an answer without its route's result member (decision 39).
            return Err(if member("error").is_some() {
                "an error object instead of an answer".into()
            } else {
                let names: Vec<&str> = results.iter().map(|(name, _)| *name).collect();
                format!(
                    "a JSON object without {}, which every answer of this route has",
                    named(&names, "or")
                )
            });
        }
        let parts = BodyParts {
            id: id.as_deref(),
            object: object.as_deref(),
            usage: member("usage"),
            usage_metadata: member("usageMetadata"),
        };
        let failed = (self == Route::OpenaiResponses
            && text("status").as_deref() == Some("failed"))
        .then(|| match member("error") {
            Some(error) => format!(
                "a response whose status is failed: {}",
                excerpt(error.as_bytes())
            ),
            None => "a response whose status is failed".to_string(),
        });
        Ok((
            self.answer_id_of_body(&parts),
            self.usage_of_body(&parts),
            failed,
        ))
    }

    /// The usage a 2xx body reports that [`Route::check_answer`] refused as no answer: the
    /// provider billed it all the same, so the failed attempt keeps it (RD-9), as a stream that
    /// failed keeps what it reported. `None` when the body holds none it can read.
    pub(crate) fn usage_of_refused_answer(self, body: &[u8]) -> Option<Usage> {
        let members = BodyMembers::read(body).ok()?;
        let member = |name: &str| members.get(name);
        self.usage_of_body(&BodyParts {
            id: None,
            object: None,
            usage: member("usage"),
            usage_metadata: member("usageMetadata"),
        })
    }
}

/// `names` in backticks, the last joined with `word`: "`a`, `b` or `c`".
fn named(names: &[&str], word: &str) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    match quoted.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} {word} {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// A JSON value's type with its article, for messages: "a string", "an array".
fn type_named(value: &str) -> &'static str {
    match value.as_bytes().first() {
        Some(b'[') => "an array",
        Some(b'{') => "an object",
        Some(b'"') => "a string",
        Some(b't' | b'f') => "a boolean",
        _ => "a number",
    }
}

/// The first 200 characters of a provider body, for messages.
pub(crate) fn excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let mut out: String = text.chars().take(200).collect();
    if text.chars().count() > 200 {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(route: Route, name: Option<&str>, data: &str) -> Result<bool, String> {
        route.inspect_event(name, data).map(|seen| seen.error)
    }

    fn ends(route: Route, name: Option<&str>, data: &str) -> bool {
        route
            .inspect_event(name, data)
            .is_ok_and(|seen| seen.ends_stream)
    }

    /// The one-pass probe reads every event as serde_json did, members and all (LC-7, LC-11,
    /// GM-3): each provider's events, `null` members, whitespace, escapes in values.
    #[test]
    fn the_one_pass_probe_reads_each_event_as_serde_json_does_lc7_lc11() {
        for data in [
            r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"h\u00e9\n"},"finish_reason":null}]}"#,
            r#"{"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}"#,
            r#"{"error":{"message":"overloaded"}}"#,
            r#"{"error":null,"choices":null,"usage":null}"#,
            r#"{"type":"message_start","message":{"id":"msg_1","usage":{"input_tokens":3}}}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":2}}"#,
            r#"{"type":"response.completed","response":{"id":"resp_1","usage":{"input_tokens":1}}}"#,
            r#"{"candidates":[{"content":{"parts":[{"text":"x"}]},"finishReason":"STOP"}],"usageMetadata":{"promptTokenCount":1}}"#,
            r#"{"promptFeedback":{"blockReason":"SAFETY"}}"#,
            "{\n \"type\" : \"ping\" ,\"x\":[1, 2.5e-3, true, false, null, {}]\t}\r\n",
            r#"{"type":null}"#,
            "{}",
        ] {
            let scanned = EventProbe::scan(data);
            assert!(scanned.is_some(), "{data}");
            assert_eq!(
                scanned,
                EventProbe::serde(data, &mut String::new()).ok(),
                "{data}"
            );
        }
        // What the pass leaves to serde_json, which reads it as before.
        for data in [
            r#"{"error":null,"error":{"m":1}}"#,
            r#"{"type":"a","type":"b"}"#,
            r#"{"type":5,"choices":[]}"#,
            r#"{"type":"a\u0062"}"#,
            r#"{"ch\u006fices":[]}"#,
            "[1]",
            "3",
        ] {
            assert_eq!(EventProbe::scan(data), None, "{data}");
            assert!(
                EventProbe::serde(data, &mut String::new()).is_ok(),
                "{data}"
            );
        }
        assert_eq!(
            EventProbe::serde(r#"{"ch\u006fices":[]}"#, &mut String::new()).map(|p| p.choices),
            Ok(true)
        );
        for data in [
            r#"{"choices":[]"#,
            r#"{"choices":[]} x"#,
            "hello",
            r#"{"a":"\q"}"#,
        ] {
            assert_eq!(EventProbe::scan(data), None, "{data}");
            assert_eq!(
                EventProbe::serde(data, &mut String::new()),
                Err(()),
                "{data}"
            );
        }
    }

    /// Data with whitespace before its object is read by serde_json as a whole value, which
    /// refuses what skipping a value accepts (a lone surrogate, a number past `f64`, nesting
    /// past 128): the one pass is not taken for it, and such an event is no JSON (LC-11).
    #[test]
    fn data_with_whitespace_before_its_object_is_read_as_serde_json_reads_it_lc11() {
        let deep = format!(
            r#" {{"choices":[],"x":{}{}}}"#,
            "[".repeat(127),
            "]".repeat(127)
        );
        for data in [
            r#" {"choices":[],"x":"\ud800"}"#,
            r#" {"choices":[],"x":1e400}"#,
            deep.as_str(),
        ] {
            assert_eq!(
                EventProbe::read(data, &mut String::new()),
                Err(()),
                "{data}"
            );
            assert!(
                Route::OpenaiChat.inspect_event(None, data).is_err(),
                "{data}"
            );
            // The same object without the whitespace is skipped, as before.
            assert!(
                Route::OpenaiChat.inspect_event(None, &data[1..]).is_ok(),
                "{data}"
            );
        }
        assert!(
            Route::OpenaiChat
                .inspect_event(None, " {\"choices\":[]}")
                .is_ok()
        );
    }

    #[test]
    fn inspect_event_validates_json_once_and_finds_error_events_lc7() {
        let chat = Route::OpenaiChat;
        assert_eq!(error(chat, None, r#"{"choices":[]}"#), Ok(false));
        assert_eq!(error(chat, None, "[DONE]"), Ok(false));
        assert_eq!(
            error(chat, None, r#"{"error":null,"choices":[]}"#),
            Ok(false)
        );
        assert_eq!(
            error(chat, None, r#"{"error":{"message":"overloaded"}}"#),
            Ok(true)
        );
        assert_eq!(error(chat, Some("error"), r#"{"type":"error"}"#), Ok(true));
        // A duplicated key is JSON serde_json::Value accepts (last one wins).
        assert_eq!(
            error(chat, None, r#"{"error":null,"error":{"m":1}}"#),
            Ok(true)
        );
        assert!(error(chat, None, r#"{"choices":[]"#).is_err());
        assert!(error(chat, None, r#"{"a":1} trailing"#).is_err());
        assert!(error(chat, None, "hello").is_err());
    }

    #[test]
    fn a_chat_or_completions_stream_event_without_choices_is_not_the_routes_lc7_lc11_decision42() {
        for route in [Route::OpenaiChat, Route::OpenaiCompletions] {
            // Every chunk carries `choices`, the usage-only chunk an empty one.
            assert_eq!(
                error(route, None, r#"{"choices":[],"usage":{}}"#),
                Ok(false)
            );
            for data in [
                r#"{"id":"x","object":"chat.completion.chunk"}"#,
                "[1, 2]",
                "3",
                r#"{"error":null}"#,
            ] {
                let refused = error(route, None, data).expect_err(data);
                assert!(refused.contains("without `choices`"), "{refused}");
            }
            // An error event is an error, not a malformed chunk; `[DONE]` ends the stream.
            assert_eq!(
                error(route, None, r#"{"error":{"message":"overloaded"}}"#),
                Ok(true)
            );
            assert!(ends(route, None, "[DONE]"));
        }
        // Other routes' events are told by their type, not by `choices`.
        assert_eq!(
            error(
                Route::OpenaiResponses,
                None,
                r#"{"type":"response.output_text.delta","delta":"hi"}"#
            ),
            Ok(false)
        );
        assert_eq!(
            error(Route::AnthropicMessages, Some("ping"), r#"{"type":"ping"}"#),
            Ok(false)
        );
    }

    /// The events of one stream, in order, through [`Route::in_order`]: the reason of the first one
    /// out of place, if any.
    fn first_misplaced(route: Route, events: &[(Option<&str>, &str)]) -> Option<String> {
        let mut order = Order::default();
        events.iter().find_map(|(name, data)| {
            let seen = route.inspect_event(*name, data).expect("valid event");
            route.in_order(&seen, &mut order, data).err()
        })
    }

    #[test]
    fn a_messages_stream_opens_with_message_start_once_lc7_lc11_decision44() {
        let route = Route::AnthropicMessages;
        let start = (
            Some("message_start"),
            r#"{"type":"message_start","message":{}}"#,
        );
        let ping = (Some("ping"), r#"{"type":"ping"}"#);
        let delta = (
            Some("content_block_delta"),
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}}"#,
        );
        let result = (
            Some("message_delta"),
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":1}}"#,
        );
        let stop = (Some("message_stop"), r#"{"type":"message_stop"}"#);
        let error = (
            Some("error"),
            r#"{"type":"error","error":{"type":"overloaded_error","message":"busy"}}"#,
        );
        // What Anthropic sends: pings and errors may come before `message_start`.
        assert_eq!(
            first_misplaced(route, &[ping, start, delta, ping, result, stop]),
            None
        );
        assert_eq!(first_misplaced(route, &[error]), None);
        // By its data's `type` when it has no `event:` name.
        assert_eq!(
            first_misplaced(
                route,
                &[
                    (None, start.1),
                    (None, delta.1),
                    (None, result.1),
                    (None, stop.1)
                ]
            ),
            None
        );
        for (events, why) in [
            (
                &[delta, stop][..],
                "began with an event other than `message_start`",
            ),
            (
                &[ping, delta, stop][..],
                "began with an event other than `message_start`",
            ),
            (
                &[stop][..],
                "began with an event other than `message_start`",
            ),
            (&[start, delta, start, stop][..], "a second `message_start`"),
        ] {
            let found = first_misplaced(route, events).expect(why);
            assert!(found.contains(why), "{found}");
        }
        // The OpenAI routes have no opening event to check.
        for route in [
            Route::OpenaiChat,
            Route::OpenaiCompletions,
            Route::OpenaiResponses,
        ] {
            assert_eq!(route.stream_start_name(), None);
        }
    }

    /// Anthropic's stream says how the answer ended in `message_delta` (`stop_reason`, which
    /// its SDKs document as non-null in every event after `message_start`, and the final
    /// usage), always before `message_stop`. A stream that reached `message_stop` without it
    /// was stored as succeeded, and the SDKs' assembled message had no stop reason and only
    /// `message_start`'s usage: a message that is not what it claims.
    #[test]
    fn a_messages_stream_whose_message_stop_comes_before_any_message_delta_is_no_answer_lc7_lc11() {
        let route = Route::AnthropicMessages;
        let start = (
            Some("message_start"),
            r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"claude-sonnet-4-5","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":9,"output_tokens":1}}}"#,
        );
        let block = (
            Some("content_block_start"),
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
        );
        let delta = (
            Some("content_block_delta"),
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}"#,
        );
        let block_stop = (
            Some("content_block_stop"),
            r#"{"type":"content_block_stop","index":0}"#,
        );
        let result = (
            Some("message_delta"),
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":2}}"#,
        );
        let stop = (Some("message_stop"), r#"{"type":"message_stop"}"#);
        assert_eq!(
            first_misplaced(route, &[start, block, delta, block_stop, result, stop]),
            None
        );
        for events in [
            &[start, block, delta, block_stop, stop][..],
            &[start, stop][..],
            &[
                (None, start.1),
                (None, delta.1),
                (Some("message_stop"), stop.1),
            ][..],
        ] {
            let found = first_misplaced(route, events).expect("no message_delta");
            assert!(
                found.contains("sent `message_stop` before any `message_delta`"),
                "{found}"
            );
        }
        // After an error event the stream is the provider's failure, judged as before.
        let error = (
            Some("error"),
            r#"{"type":"error","error":{"type":"overloaded_error","message":"busy"}}"#,
        );
        assert_eq!(first_misplaced(route, &[start, delta, error, stop]), None);
        // The other routes have no such event.
        for route in [
            Route::OpenaiChat,
            Route::OpenaiResponses,
            Route::GeminiStream,
        ] {
            assert_eq!(route.stream_result_name(), None);
        }
    }

    /// LC-7a: a Responses `response.failed` ends the stream as an error event, by its
    /// `event:` name or its data's `type`, and a non-stream Responses object whose `status` is
    /// `failed` is a failed answer; `response.incomplete` and every other answer are not.
    #[test]
    fn a_failed_responses_answer_is_an_error_not_a_success_lc7a() {
        let route = Route::OpenaiResponses;
        let failed = r#"{"type":"response.failed","sequence_number":3,"response":{"id":"resp_1","status":"failed","error":{"code":"server_error"}}}"#;
        for name in [Some("response.failed"), None] {
            let seen = route
                .inspect_event(name, failed)
                .expect("a Responses event");
            assert!(seen.error && seen.ends_stream, "{name:?}");
        }
        let incomplete = r#"{"type":"response.incomplete","sequence_number":3,"response":{"id":"resp_1","status":"incomplete"}}"#;
        let seen = route
            .inspect_event(Some("response.incomplete"), incomplete)
            .expect("a Responses event");
        assert!(!seen.error && seen.ends_stream);
        let answer = |status: &str| {
            format!(
                r#"{{"id":"resp_1","object":"response","status":"{status}","output":[],"error":{{"code":"server_error"}}}}"#
            )
        };
        let failed = |route: Route, status: &str| {
            route
                .check_answer(answer(status).as_bytes())
                .map(|(.., failed)| failed)
        };
        let why = failed(route, "failed").expect("an answer");
        assert!(why.is_some_and(|why| why.contains("server_error")));
        for status in ["completed", "incomplete"] {
            assert_eq!(failed(route, status), Ok(None), "{status}");
        }
        assert!(
            !matches!(failed(Route::OpenaiChat, "failed"), Ok(Some(_))),
            "only the Responses API answers with a status"
        );
    }

    #[test]
    fn each_route_is_completed_only_by_its_own_final_event_lc7() {
        for route in [Route::OpenaiChat, Route::OpenaiCompletions] {
            assert!(ends(route, None, "[DONE]"));
            let last = r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#;
            assert!(
                !ends(route, None, last),
                "finish_reason alone is not the end"
            );
        }
        let responses = Route::OpenaiResponses;
        for kind in [
            "response.completed",
            "response.incomplete",
            "response.failed",
        ] {
            let data = format!(r#"{{"type":"{kind}","sequence_number":9,"response":{{}}}}"#);
            assert!(ends(responses, Some(kind), &data), "{kind}");
            assert!(ends(responses, None, &data), "{kind} by its data's type");
        }
        assert!(!ends(
            responses,
            Some("response.output_text.done"),
            r#"{"type":"response.output_text.done"}"#
        ));
        assert!(!ends(responses, None, "[DONE]"));
        let messages = Route::AnthropicMessages;
        assert!(ends(
            messages,
            Some("message_stop"),
            r#"{"type":"message_stop"}"#
        ));
        assert!(!ends(
            messages,
            Some("message_delta"),
            r#"{"type":"message_delta"}"#
        ));
        assert!(!ends(messages, None, "[DONE]"));
    }

    /// What a stream's events report, each replacing the last field by field, as an attempt
    /// keeps it ([`Usage::update`]).
    fn stream_usage(route: Route, events: &[(&str, &str)]) -> Usage {
        let mut usage = Usage::default();
        for (name, data) in events {
            let seen = route
                .inspect_event(Some(name), data)
                .expect("a valid event");
            if let Some(later) = seen.usage {
                usage.update(later);
            }
        }
        usage
    }

    /// Anthropic documents a `message_delta`'s usage as cumulative, input and prompt-cache
    /// counts included; they grow past `message_start`'s when server tools run within the turn
    /// (a web search reads its results as input), and the SDKs and langchain-anthropic take
    /// the delta's. The ledger took only its output, so such a stream's input was billed short.
    #[test]
    fn a_messages_streams_usage_takes_the_cumulative_input_and_cache_counts_of_message_delta_rd9() {
        let messages = Route::AnthropicMessages;
        let start = (
            "message_start",
            r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"claude-sonnet-4-5","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":2679,"cache_creation_input_tokens":0,"cache_read_input_tokens":1000,"output_tokens":3}}}"#,
        );
        let stop = ("message_stop", r#"{"type":"message_stop"}"#);
        let delta = |usage: &str| {
            format!(
                r#"{{"type":"message_delta","delta":{{"stop_reason":"end_turn","stop_sequence":null}},"usage":{usage}}}"#
            )
        };
        // After a server tool ran: every count cumulative, input grown.
        let grown = delta(
            r#"{"input_tokens":10682,"cache_creation_input_tokens":12,"cache_read_input_tokens":1000,"output_tokens":510,"server_tool_use":{"web_search_requests":1}}"#,
        );
        assert_eq!(
            stream_usage(messages, &[start, ("message_delta", &grown), stop]),
            Usage {
                input_tokens: Some(10682 + 12 + 1000),
                output_tokens: Some(510),
                cached_input_tokens: Some(1000),
                cache_write_tokens: Some(12),
                reasoning_tokens: None,
                cache_write_1h_tokens: None,
            }
        );
        // A delta with only its output (older API versions, some gateways), or without one of
        // the cache counts, cannot be normalised: message_start's input stands. So it does
        // when a compatible server that takes the delta for output alone writes zeros for the
        // rest: no call reads no input.
        for usage in [
            r#"{"output_tokens":510}"#,
            r#"{"input_tokens":10682,"output_tokens":510}"#,
            r#"{"input_tokens":0,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":510}"#,
        ] {
            let only = delta(usage);
            assert_eq!(
                stream_usage(messages, &[start, ("message_delta", &only), stop]),
                Usage {
                    input_tokens: Some(2679 + 1000),
                    output_tokens: Some(510),
                    cached_input_tokens: Some(1000),
                    cache_write_tokens: Some(0),
                    reasoning_tokens: None,
                    cache_write_1h_tokens: None,
                },
                "{usage}"
            );
        }
    }

    /// RD-9, decision 122: Anthropic reports the thinking part of the output in
    /// `usage.output_tokens_details.thinking_tokens` (anthropic-python 2.14's `Usage` and
    /// `MessageDeltaUsage`), in a non-stream answer and in a stream's `message_start` and
    /// `message_delta`: it is the reasoning, as OpenAI's `reasoning_tokens` and Gemini's
    /// `thoughtsTokenCount` are. holdfast reported no reasoning for Anthropic at all. A details
    /// object that cannot be read costs only itself.
    #[test]
    fn anthropics_thinking_tokens_are_the_reasoning_of_its_output_rd9() {
        let messages = Route::AnthropicMessages;
        let body = r#"{"id":"msg_1","type":"message","role":"assistant","content":[{"type":"thinking","thinking":"hm","signature":"s"},{"type":"text","text":"hi"}],"model":"claude-sonnet-4-5","stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":20,"output_tokens":40,"output_tokens_details":{"thinking_tokens":31}}}"#;
        let (_, answered, _) = messages.check_answer(body.as_bytes()).expect("an answer");
        let answered = answered.expect("usage");
        assert_eq!(
            (answered.output_tokens, answered.reasoning_tokens),
            (Some(40), Some(31))
        );

        let start = r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"claude-sonnet-4-5","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":20,"output_tokens":1,"output_tokens_details":{"thinking_tokens":0}}}}"#;
        let delta = r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":40,"output_tokens_details":{"thinking_tokens":31}}}"#;
        let stop = ("message_stop", r#"{"type":"message_stop"}"#);
        let streamed = stream_usage(
            messages,
            &[("message_start", start), ("message_delta", delta), stop],
        );
        assert_eq!(
            (streamed.output_tokens, streamed.reasoning_tokens),
            (Some(40), Some(31))
        );
        // Without the details, or with details that cannot be read: no reasoning, the rest kept.
        for details in [
            "",
            r#","output_tokens_details":null"#,
            r#","output_tokens_details":7"#,
        ] {
            let body = format!(
                r#"{{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"m","stop_reason":"end_turn","usage":{{"input_tokens":20,"output_tokens":40{details}}}}}"#
            );
            let (_, answered, _) = messages.check_answer(body.as_bytes()).expect("an answer");
            let answered = answered.expect("usage");
            assert_eq!(
                (answered.output_tokens, answered.reasoning_tokens),
                (Some(40), None),
                "{details}"
            );
        }
    }

    /// Anthropic bills a one-hour prompt-cache write (`cache_control` with `ttl: "1h"`, as
    /// Claude Code sends) at twice the input price, a five-minute one at 1.25 times, and
    /// reports the split in `usage.cache_creation` beside the total: in a non-stream answer's
    /// usage and in `message_start`'s, not in `message_delta`'s. The ledger kept the total
    /// alone, so every one-hour write was priced as a five-minute one.
    #[test]
    fn a_messages_answer_keeps_its_one_hour_cache_writes_apart_streamed_and_not_rd10() {
        let messages = Route::AnthropicMessages;
        let usage = r#"{"input_tokens":20,"cache_creation_input_tokens":3000,"cache_read_input_tokens":500,"cache_creation":{"ephemeral_5m_input_tokens":1000,"ephemeral_1h_input_tokens":2000},"output_tokens":40}"#;
        let expected = Usage {
            input_tokens: Some(20 + 3000 + 500),
            output_tokens: Some(40),
            cached_input_tokens: Some(500),
            cache_write_tokens: Some(3000),
            reasoning_tokens: None,
            cache_write_1h_tokens: Some(2000),
        };
        let body = format!(
            r#"{{"id":"msg_1","type":"message","role":"assistant","content":[{{"type":"text","text":"hi"}}],"model":"claude-sonnet-4-5","stop_reason":"end_turn","stop_sequence":null,"usage":{usage}}}"#
        );
        let (_, answered, _) = messages.check_answer(body.as_bytes()).expect("an answer");
        assert_eq!(answered, Some(expected));

        let start = format!(
            r#"{{"type":"message_start","message":{{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"claude-sonnet-4-5","stop_reason":null,"stop_sequence":null,"usage":{usage}}}}}"#
        );
        let stop = ("message_stop", r#"{"type":"message_stop"}"#);
        // Anthropic's delta: cumulative counts, no `cache_creation`; message_start's split stands.
        let delta = r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"input_tokens":20,"cache_creation_input_tokens":3000,"cache_read_input_tokens":500,"output_tokens":40}}"#;
        assert_eq!(
            stream_usage(
                messages,
                &[("message_start", &start), ("message_delta", delta), stop]
            ),
            expected
        );
        // A delta that does carry the split, with the counts it replaces, is taken.
        let grown = r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"input_tokens":20,"cache_creation_input_tokens":3500,"cache_read_input_tokens":500,"cache_creation":{"ephemeral_5m_input_tokens":1000,"ephemeral_1h_input_tokens":2500},"output_tokens":40}}"#;
        assert_eq!(
            stream_usage(
                messages,
                &[("message_start", &start), ("message_delta", grown), stop]
            ),
            Usage {
                input_tokens: Some(20 + 3500 + 500),
                cache_write_tokens: Some(3500),
                cache_write_1h_tokens: Some(2500),
                ..expected
            }
        );
        // Without `cache_creation` (older API versions, compatible servers): not reported.
        let plain = r#"{"input_tokens":20,"cache_creation_input_tokens":3000,"output_tokens":40}"#;
        let body = format!(
            r#"{{"id":"msg_1","type":"message","role":"assistant","content":[],"usage":{plain}}}"#
        );
        let (_, answered, _) = messages.check_answer(body.as_bytes()).expect("an answer");
        assert_eq!(answered.and_then(|u| u.cache_write_1h_tokens), None);
    }

    /// The usage a non-stream answer's `body` reports.
    fn body_usage(route: Route, body: &str) -> Option<Usage> {
        route.check_answer(body.as_bytes()).expect("an answer").1
    }

    /// Anthropic's `usage.cache_creation` is an object (its SDKs' `CacheCreation`), but a
    /// compatible server may send `null` or anything else there; the usage was read all or
    /// nothing, so one unreadable member lost every count of the answer, billed tokens
    /// included. Each member is now read on its own: only what cannot be read is not reported.
    #[test]
    fn a_usage_member_that_cannot_be_read_loses_only_itself_never_the_counts_beside_it_rd9() {
        let messages = Route::AnthropicMessages;
        let counts = Usage {
            input_tokens: Some(20 + 3000 + 500),
            output_tokens: Some(40),
            cached_input_tokens: Some(500),
            cache_write_tokens: Some(3000),
            reasoning_tokens: None,
            cache_write_1h_tokens: None,
        };
        for odd in [
            "null",
            r#""5m""#,
            "7",
            "[]",
            "true",
            r#"{"ephemeral_1h_input_tokens":"x"}"#,
        ] {
            let usage = format!(
                r#"{{"input_tokens":20,"cache_creation_input_tokens":3000,"cache_read_input_tokens":500,"cache_creation":{odd},"output_tokens":40}}"#
            );
            let body = format!(
                r#"{{"id":"msg_1","type":"message","role":"assistant","content":[{{"type":"text","text":"hi"}}],"model":"claude-sonnet-4-5","stop_reason":"end_turn","stop_sequence":null,"usage":{usage}}}"#
            );
            assert_eq!(body_usage(messages, &body), Some(counts), "{odd}");
            let start = format!(
                r#"{{"type":"message_start","message":{{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"claude-sonnet-4-5","stop_reason":null,"stop_sequence":null,"usage":{usage}}}}}"#
            );
            let delta = format!(
                r#"{{"type":"message_delta","delta":{{"stop_reason":"end_turn","stop_sequence":null}},"usage":{usage}}}"#
            );
            let stop = ("message_stop", r#"{"type":"message_stop"}"#);
            assert_eq!(
                stream_usage(
                    messages,
                    &[("message_start", &start), ("message_delta", &delta), stop]
                ),
                counts,
                "{odd}"
            );
        }
        // A count that is not one is not reported; the others are. The normalised input adds
        // the cache counts to `input_tokens`: with one of them unreadable it is unknown, not
        // guessed.
        let body = |usage: &str| format!(r#"{{"type":"message","content":[],"usage":{usage}}}"#);
        assert_eq!(
            body_usage(
                messages,
                &body(r#"{"input_tokens":20,"cache_read_input_tokens":500,"output_tokens":"40"}"#)
            ),
            Some(Usage {
                input_tokens: Some(520),
                cached_input_tokens: Some(500),
                ..Usage::default()
            })
        );
        assert_eq!(
            body_usage(
                messages,
                &body(
                    r#"{"input_tokens":20,"cache_read_input_tokens":-1,"cache_creation_input_tokens":null,"output_tokens":40}"#
                )
            ),
            Some(Usage {
                output_tokens: Some(40),
                ..Usage::default()
            })
        );

        // OpenAI: `*_details` null (vLLM, many compatible servers) or of another type.
        let chat = Route::OpenaiChat;
        for (prompt, completion) in [
            ("null", "null"),
            (r#""x""#, "[]"),
            ("7", r#"{"reasoning_tokens":"3"}"#),
        ] {
            let body = format!(
                r#"{{"choices":[{{}}],"usage":{{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17,"prompt_tokens_details":{prompt},"completion_tokens_details":{completion}}}}}"#
            );
            assert_eq!(
                body_usage(chat, &body),
                Some(Usage {
                    input_tokens: Some(12),
                    output_tokens: Some(5),
                    ..Usage::default()
                }),
                "{prompt} {completion}"
            );
        }
        let body = r#"{"choices":[{}],"usage":{"prompt_tokens":12,"completion_tokens":null,"prompt_tokens_details":{"cached_tokens":"4","audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":3}}}"#;
        assert_eq!(
            body_usage(chat, body),
            Some(Usage {
                input_tokens: Some(12),
                reasoning_tokens: Some(3),
                ..Usage::default()
            })
        );
        let responses = Route::OpenaiResponses;
        let body = r#"{"object":"response","id":"resp_1","output":[],"usage":{"input_tokens":9,"input_tokens_details":null,"output_tokens":4,"output_tokens_details":"none"}}"#;
        assert_eq!(
            body_usage(responses, body),
            Some(Usage {
                input_tokens: Some(9),
                output_tokens: Some(4),
                ..Usage::default()
            })
        );

        // Gemini: a count of another type, or null; the detail lists are not read.
        let gemini = Route::GeminiGenerate;
        let body = r#"{"candidates":[],"usageMetadata":{"promptTokenCount":10,"candidatesTokenCount":5,"cachedContentTokenCount":"4","thoughtsTokenCount":null,"promptTokensDetails":null,"cacheTokensDetails":"x","totalTokenCount":15}}"#;
        assert_eq!(
            body_usage(gemini, body),
            Some(Usage {
                input_tokens: Some(10),
                output_tokens: Some(5),
                ..Usage::default()
            })
        );
        // The input is the prompt plus the tool-use prompt: one of them unreadable, unknown.
        let body = r#"{"candidates":[],"usageMetadata":{"promptTokenCount":10,"toolUsePromptTokenCount":2.5,"candidatesTokenCount":5,"cachedContentTokenCount":4}}"#;
        assert_eq!(
            body_usage(gemini, body),
            Some(Usage {
                output_tokens: Some(5),
                cached_input_tokens: Some(4),
                ..Usage::default()
            })
        );
        let chunk = r#"{"candidates":[{"content":{"parts":[{"text":"x"}]},"finishReason":"STOP"}],"usageMetadata":{"promptTokenCount":"10","candidatesTokenCount":5,"thoughtsTokenCount":2}}"#;
        assert_eq!(
            Route::GeminiStream
                .inspect_event(None, chunk)
                .expect("a chunk")
                .usage,
            Some(Usage {
                output_tokens: Some(7),
                reasoning_tokens: Some(2),
                ..Usage::default()
            })
        );
    }

    /// [`Route::check_answer`]'s verdict and the answer's id, without the usage.
    fn answer_id(route: Route, body: &[u8]) -> Result<Option<String>, String> {
        route.check_answer(body).map(|(id, ..)| id)
    }

    #[test]
    fn a_2xx_answer_must_be_an_object_with_the_routes_result_member_lc11_decision39() {
        let chat = Route::OpenaiChat;
        assert_eq!(
            answer_id(
                chat,
                br#"{"choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}],"error":null}"#
            ),
            Ok(None)
        );
        // Nor one whose `choices` is empty: no choice answered (decision 143).
        for body in [
            &br#"{"choices":[]}"#[..],
            br#"{"choices":[ ],"usage":{"prompt_tokens":3}}"#,
            br#"{"error":{"message":"upstream"},"choices":[]}"#,
        ] {
            for route in [chat, Route::OpenaiCompletions] {
                let verdict = answer_id(route, body);
                assert!(
                    verdict
                        .as_ref()
                        .is_err_and(|e| e.contains("`choices` is empty")),
                    "{route:?} {verdict:?}"
                );
            }
        }
        // An object without the route's result member is no answer (decision 39).
        assert_eq!(
            answer_id(chat, br#"{"id":"x"}"#),
            Err("a JSON object without `choices`, which every answer of this route has".into())
        );
        assert!(answer_id(chat, b"{}").is_err());
        assert!(answer_id(Route::OpenaiEmbeddings, br#"{"object":"list"}"#).is_err());
        assert!(answer_id(Route::OpenaiResponses, br#"{"id":"resp_1"}"#).is_err());
        assert!(answer_id(Route::AnthropicMessages, br#"{"type":"message"}"#).is_err());
        assert_eq!(
            answer_id(
                Route::AnthropicMessages,
                br#"{"type":"message","content":[]}"#
            ),
            Ok(None)
        );
        assert!(answer_id(chat, br#"{"error":{"message":"overloaded"}}"#).is_err());
        assert!(answer_id(chat, br#" [1,2]"#).is_err());
        assert!(answer_id(chat, br#""text""#).is_err());
        assert!(answer_id(chat, b"not json").is_err());
        // An answer with both is the provider's answer (a failed Responses object has both).
        let failed = br#"{"object":"response","id":"resp_1","status":"failed","output":[],"error":{"code":"server_error"}}"#;
        assert_eq!(
            answer_id(Route::OpenaiResponses, failed),
            Ok(Some("resp_1".into())),
            "and its id is kept"
        );
        let refused = br#"{"type":"error","error":{"type":"overloaded_error","message":"x"}}"#;
        assert!(answer_id(Route::AnthropicMessages, refused).is_err());
        assert_eq!(
            answer_id(
                Route::AnthropicMessages,
                br#"{"type":"message","content":[]}"#
            ),
            Ok(None)
        );
        assert!(
            answer_id(
                Route::OpenaiEmbeddings,
                br#"{"error":{"m":1},"choices":[]}"#
            )
            .is_err()
        );
        // A duplicated key keeps its last value, as every SDK reads it.
        assert!(answer_id(chat, br#"{"error":null,"error":{"m":1}}"#).is_err());
        assert_eq!(
            answer_id(chat, br#"{"choices":1,"choices":[{}]}"#),
            Ok(None)
        );
        // What the one-pass read leaves to serde_json is read as before: an escaped key, text
        // that is not UTF-8, nesting past its depth.
        assert_eq!(
            answer_id(
                Route::OpenaiResponses,
                br#"{"\u0069d":"resp_1","object":"response","outp\u0075t":[]}"#
            ),
            Ok(Some("resp_1".into()))
        );
        assert_eq!(
            answer_id(chat, b"{\"choices\":[],\"x\":\"\xff\"}"),
            Err("JSON that is not an object".into())
        );
        let deep = format!(
            r#"{{"choices":[{{}}],"x":{}{}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        assert_eq!(answer_id(chat, deep.as_bytes()), Ok(None));
        assert_eq!(
            answer_id(chat, b" [1,2]"),
            Err("JSON that is not an object".into())
        );
    }

    /// The Messages API answers `content` as an array of content blocks, always (its SDKs'
    /// `content: List[ContentBlock]`, which they index and iterate); a body whose `content` is
    /// a string, as some gateways write it, was stored as succeeded and replayed, although no
    /// SDK reads it as the message it claims to be. Every route's result member has one JSON
    /// type, and an answer whose member has another is no answer: `upstream_invalid`, as a chat
    /// answer without `choices` is.
    #[test]
    fn an_answer_whose_result_member_is_not_of_its_type_is_not_an_answer_lc11() {
        let messages = Route::AnthropicMessages;
        let message = |content: &str| {
            format!(
                r#"{{"id":"msg_1","type":"message","role":"assistant","content":{content},"model":"claude-sonnet-4-5","stop_reason":"end_turn","stop_sequence":null,"usage":{{"input_tokens":3,"output_tokens":2}}}}"#
            )
        };
        for (content, kind) in [
            (r#""Hello!""#, "a string"),
            (r#"{"type":"text","text":"Hello!"}"#, "an object"),
            ("42", "a number"),
            ("true", "a boolean"),
        ] {
            let refused = messages
                .check_answer(message(content).as_bytes())
                .expect_err(content);
            assert_eq!(
                refused,
                format!(
                    "a JSON object whose `content` is {kind}, not the array every answer of this \
                     route has"
                ),
                "{content}"
            );
        }
        let (_, usage, _) = messages
            .check_answer(message(r#"[{"type":"text","text":"Hello!"}]"#).as_bytes())
            .expect("a message");
        assert_eq!(usage.and_then(|u| u.output_tokens), Some(2));
        // The same rule on every route.
        for (route, body) in [
            (
                Route::OpenaiChat,
                r#"{"id":"c","object":"chat.completion","choices":"Hello!"}"#,
            ),
            (Route::OpenaiChat, r#"{"choices":{"0":{"message":{}}}}"#),
            (Route::OpenaiCompletions, r#"{"choices":"Hello!"}"#),
            (
                Route::OpenaiEmbeddings,
                r#"{"object":"list","data":{"embedding":[]}}"#,
            ),
            (
                Route::OpenaiResponses,
                r#"{"object":"response","id":"r","output":"Hello!"}"#,
            ),
            (Route::GeminiGenerate, r#"{"candidates":{"content":{}}}"#),
            (Route::GeminiGenerate, r#"{"promptFeedback":"SAFETY"}"#),
            (
                Route::GeminiGenerate,
                r#"{"candidates":[],"usageMetadata":[3]}"#,
            ),
        ] {
            assert!(route.check_answer(body.as_bytes()).is_err(), "{body}");
        }
        // `null` is absent, as before: another member may answer.
        assert!(
            Route::GeminiGenerate
                .check_answer(br#"{"candidates":null,"promptFeedback":{"blockReason":"OTHER"}}"#)
                .is_ok()
        );
    }

    #[test]
    fn a_gemini_chunk_needs_a_candidate_feedback_or_usage_and_finishes_at_finish_reason_gm3() {
        let route = Route::GeminiStream;
        let text =
            r#"{"candidates":[{"content":{"parts":[{"text":"hi"}],"role":"model"},"index":0}]}"#;
        let last = r#"{"candidates":[{"content":{"parts":[{"text":""}]},"finishReason":"STOP"}],"usageMetadata":{"promptTokenCount":3,"candidatesTokenCount":2}}"#;
        let seen = route.inspect_event(None, text).expect("a chunk");
        assert!(!seen.finishes_answer && !seen.ends_stream && !seen.error);
        let seen = route.inspect_event(None, last).expect("the last chunk");
        assert!(seen.finishes_answer, "finishReason finishes the answer");
        assert!(
            !seen.ends_stream,
            "but reading goes on to the end of the body"
        );
        assert_eq!(seen.usage.and_then(|u| u.output_tokens), Some(2));
        let blocked =
            r#"{"promptFeedback":{"blockReason":"SAFETY"},"usageMetadata":{"promptTokenCount":3}}"#;
        assert!(
            route
                .inspect_event(None, blocked)
                .expect("blocked")
                .finishes_answer
        );
        let error = r#"{"error":{"code":500,"message":"x","status":"INTERNAL"}}"#;
        assert_eq!(error_of(route, error), Ok(true));
        let refused = route
            .inspect_event(None, r#"{"id":"x"}"#)
            .expect_err("not a Gemini chunk");
        assert!(
            refused.contains("without `candidates`, `promptFeedback` or `usageMetadata`"),
            "{refused}"
        );
        assert!(
            route
                .inspect_event(None, "[DONE]")
                .is_ok_and(|s| !s.finishes_answer)
        );
        assert!(route.inspect_event(None, "nope").is_err());
        // A duplicated key: the last one counts, as for the other routes.
        let twice = r#"{"candidates":[],"candidates":[{"finishReason":"STOP"}]}"#;
        assert!(
            route
                .inspect_event(None, twice)
                .expect("dup")
                .finishes_answer
        );
    }

    fn error_of(route: Route, data: &str) -> Result<bool, String> {
        error(route, None, data)
    }

    #[test]
    fn a_gemini_answer_holds_candidates_prompt_feedback_or_usage_metadata_lc11_gm3() {
        let route = Route::GeminiGenerate;
        let (id, usage, _) = route
            .check_answer(br#"{"candidates":[],"usageMetadata":{"promptTokenCount":4,"candidatesTokenCount":6}}"#)
            .expect("an answer");
        assert_eq!(id, None);
        assert_eq!(usage.and_then(|u| u.input_tokens), Some(4));
        assert!(
            route
                .check_answer(br#"{"promptFeedback":{"blockReason":"OTHER"}}"#)
                .is_ok()
        );
        let error = route
            .check_answer(br#"{"error":{"code":400,"message":"x","status":"INVALID_ARGUMENT"}}"#)
            .expect_err("an error in a 200");
        assert_eq!(error, "an error object instead of an answer");
        // Decision 90: Gemini 2.5 answers some prompts with neither candidates nor feedback,
        // only the usage it bills; google-genai returns that as a response without text.
        let (_, usage, _) = route
            .check_answer(
                br#"{"usageMetadata":{"promptTokenCount":9291,"totalTokenCount":9291},"modelVersion":"gemini-2.5-pro","responseId":"r"}"#,
            )
            .expect("an answer in which the model generated nothing");
        assert_eq!(usage.and_then(|u| u.input_tokens), Some(9291));
        let none = route
            .check_answer(br#"{"modelVersion":"gemini-2.5-pro"}"#)
            .expect_err("no answer");
        assert!(
            none.contains("without `candidates`, `promptFeedback` or `usageMetadata`"),
            "{none}"
        );
        assert!(route.check_answer(b"<html></html>").is_err());
        // A usage report is an answer only as counts with no error beside them.
        let error = route
            .check_answer(
                br#"{"error":{"code":500,"message":"x"},"usageMetadata":{"promptTokenCount":3}}"#,
            )
            .expect_err("an error beside a usage report");
        assert_eq!(error, "an error object instead of an answer");
        for empty in [&br#"{"usageMetadata":{}}"#[..], br#"{"usageMetadata":7}"#] {
            assert!(route.check_answer(empty).is_err(), "{empty:?}");
        }
    }
}
