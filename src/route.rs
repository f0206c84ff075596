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
