//! The client-facing endpoints holdfast proxies (SPEC §0 "route", HTTP-1).

use crate::config::BackendKind;

/// One proxied endpoint. The name (`openai.chat`, ...) is stored with each request and is part
/// of its hash (ID-3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// `POST /v1/chat/completions`.
    OpenaiChat,
    /// `POST /v1/completions`.
    OpenaiCompletions,
    /// `POST /v1/embeddings`.
    OpenaiEmbeddings,
    /// `POST /v1/responses`.
    OpenaiResponses,
    /// `POST /v1/messages`.
    AnthropicMessages,
}

impl Route {
    /// Every route, in documentation order.
    pub const ALL: [Route; 5] = [
        Route::OpenaiChat,
        Route::OpenaiCompletions,
        Route::OpenaiEmbeddings,
        Route::OpenaiResponses,
        Route::AnthropicMessages,
    ];

    /// The stored name, e.g. `openai.chat`.
    pub fn name(self) -> &'static str {
        match self {
            Route::OpenaiChat => "openai.chat",
            Route::OpenaiCompletions => "openai.completions",
            Route::OpenaiEmbeddings => "openai.embeddings",
            Route::OpenaiResponses => "openai.responses",
            Route::AnthropicMessages => "anthropic.messages",
        }
    }

    /// Parses a stored name.
    pub fn from_name(name: &str) -> Option<Route> {
        Route::ALL.into_iter().find(|r| r.name() == name)
    }

    /// The path clients call on holdfast.
    pub fn client_path(self) -> &'static str {
        match self {
            Route::OpenaiChat => "/v1/chat/completions",
            Route::OpenaiCompletions => "/v1/completions",
            Route::OpenaiEmbeddings => "/v1/embeddings",
            Route::OpenaiResponses => "/v1/responses",
            Route::AnthropicMessages => "/v1/messages",
        }
    }

    /// The path appended to a backend's `base_url` (which includes `/v1`).
    pub fn upstream_path(self) -> &'static str {
        &self.client_path()["/v1".len()..]
    }

    /// The backend kind that serves this route.
    pub fn kind(self) -> BackendKind {
        match self {
            Route::AnthropicMessages => BackendKind::Anthropic,
            _ => BackendKind::Openai,
        }
    }

    /// Whether a provider stream event completes this route's stream (LC-7): `data: [DONE]` on
    /// the OpenAI chat, completions and embeddings routes; a `response.completed`,
    /// `response.incomplete` or `response.failed` event on the Responses route (the last two
    /// are the provider's own final answers); `message_stop` on Anthropic's Messages route.
    /// `kind` is the event's type: its `event:` name, else the `type` member of its data.
    pub fn ends_stream(self, data: &str, kind: Option<&str>) -> bool {
        match self {
            Route::OpenaiChat | Route::OpenaiCompletions | Route::OpenaiEmbeddings => {
                data == "[DONE]"
            }
            Route::OpenaiResponses => matches!(
                kind,
                Some("response.completed" | "response.incomplete" | "response.failed")
            ),
            Route::AnthropicMessages => kind == Some("message_stop"),
        }
    }

    /// The name of the event that completes this route's stream, for messages.
    pub fn stream_end_name(self) -> &'static str {
        match self {
            Route::OpenaiChat | Route::OpenaiCompletions | Route::OpenaiEmbeddings => {
                "data: [DONE]"
            }
            Route::OpenaiResponses => "response.completed",
            Route::AnthropicMessages => "message_stop",
        }
    }

    /// Top-level members of a non-stream answer that make it this route's result: a 2xx JSON
    /// object with a non-null `error` and none of these is an error, not an answer (LC-11).
    pub fn result_members(self) -> &'static [&'static str] {
        match self {
            Route::OpenaiChat | Route::OpenaiCompletions => &["choices"],
            Route::OpenaiEmbeddings => &["data"],
            Route::OpenaiResponses => &["output"],
            Route::AnthropicMessages => &["content"],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_upstream_paths_drop_the_version_prefix() {
        for r in Route::ALL {
            assert_eq!(Route::from_name(r.name()), Some(r));
            assert!(r.client_path().ends_with(r.upstream_path()));
            assert!(r.upstream_path().starts_with('/'));
        }
        assert_eq!(Route::OpenaiChat.upstream_path(), "/chat/completions");
        assert_eq!(Route::AnthropicMessages.upstream_path(), "/messages");
    }
}
