//! Google's Gemini routes (GM-1, GM-4). The router cannot match `{model}:generateContent` in
//! one path segment, so every `POST /{version}/models/{call}` comes here and is dispatched by
//! the method after the last colon (a `POST` on `/v1/models/{id}` without one of Google's
//! methods is OpenAI's model lookup with a wrong method, IN-1): `generateContent` and
//! `streamGenerateContent` to the proxied
//! route of that method ([`proxy::handle`], the model taken from the path), `countTokens`,
//! `embedContent` and `batchEmbedContents` forwarded unlogged to the backend the model routes
//! to. `GET /v1beta/models` is the merged
//! model list ([`passthrough::models_of`]); one model is [`passthrough::model`].

use std::collections::HashMap;

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, Uri};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::Value;

use super::errors::ApiError;
use super::{AppState, namespace, passthrough, proxy};
use crate::provider::{Provider, Route};

const SHAPE: Provider = Provider::Gemini;

/// `POST /{version}/models/{model}:{method}` under `router_path` (a [`Route::router_path`]).
pub(super) async fn call(
    state: AppState,
    router_path: &'static str,
    call: String,
    uri: Uri,
    mut headers: HeaderMap,
    body: Body,
) -> Response {
    // `/v1/models/{id}` is OpenAI's too: a `POST` there without one of Google's methods after
    // the last colon (an OpenAI fine-tuned model id has colons of its own) is a wrong method
    // on OpenAI's model lookup, not a Gemini call (IN-1).
    if Provider::for_path(uri.path()) != SHAPE {
        return super::method_not_allowed(uri).await;
    }
    let Some((model, method)) = call.rsplit_once(':') else {
        // A model's lookup, served with `GET` (GM-4).
        return super::method_not_allowed(uri).await;
    };
    if !Route::is_path_model(model) {
        return ApiError::bad_request(
            SHAPE,
            "invalid_model",
            format!(
                "the model in the path, {model:?}, must be letters, digits, `.`, `-` or `_` \
                 (at most 256)"
            ),
        )
        .into_response();
    }
    key_from_query(&uri, &mut headers);
    if FORWARDED_METHODS.contains(&method) {
        return forward(state, router_path, model, method, &headers, body).await;
    }
    let Some(route) = Route::of_method(router_path, method) else {
        return no_route(&uri);
    };
    if route.streams(false) && !asks_for_sse(&uri) {
        // Without `alt=sse` Google streams one JSON array, which holdfast does not (GM-1).
        return ApiError::bad_request(
            SHAPE,
            "unsupported_stream_format",
            "holdfast streams Gemini answers as server-sent events only: add `?alt=sse`",
        )
        .into_response();
    }
    proxy::handle(State(state), route, Some(model.to_owned()), headers, body).await
}

/// Google's model methods forwarded unlogged to the backend the model routes to (GM-4,
/// HTTP-4): token counting and embeddings, which generate nothing (decision 91).
pub(super) const FORWARDED_METHODS: [&str; 3] =
    ["countTokens", "embedContent", "batchEmbedContents"];

/// Whether the `/models/` path segment `call` names a method served here with `POST`
/// (`generateContent`, `streamGenerateContent`, and the [`FORWARDED_METHODS`]): another method
/// on it is 405, not a lookup of a model so named (IN-1; a model in the path has no colon,
/// GM-1).
pub(super) fn is_post_call(call: &str) -> bool {
    call.rsplit_once(':').is_some_and(|(_, method)| {
        FORWARDED_METHODS.contains(&method)
            || Route::ALL
                .into_iter()
                .any(|r| r.model_in_path() && Route::of_method(r.router_path(), method).is_some())
    })
}

/// The methods `path` takes when it is `/{version}/models/{x}`, one router path for two
/// resources: a model call ([`is_post_call`]) takes `POST`, a model lookup `GET` and `HEAD`
/// (IN-1). `None` for any other path.
pub(super) fn methods_of_models_path(path: &str) -> Option<&'static str> {
    let call = SHAPE
        .path_prefixes()
        .iter()
        .find_map(|version| path.strip_prefix(version)?.strip_prefix("/models/"))?;
    if call.is_empty() || call.contains('/') {
        return None;
    }
    Some(if is_post_call(call) {
        "POST"
    } else {
        "GET,HEAD"
    })
}

/// `GET /v1beta/models`: the merged model list in Gemini's shape.
pub(super) async fn models(
    State(state): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
    uri: Uri,
    mut headers: HeaderMap,
) -> Response {
    key_from_query(&uri, &mut headers);
    passthrough::models_of(&state, SHAPE, &query, &headers)
        .await
        .into_response()
}

/// `countTokens`, `embedContent`, `batchEmbedContents` ([`FORWARDED_METHODS`]): forwarded to
/// the backend the model routes to, the rewritten model in the path, not logged (HTTP-4).
async fn forward(
    state: AppState,
    router_path: &'static str,
    model: &str,
    method: &str,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    if let Err(e) = namespace(&state.config, headers, SHAPE) {
        return e.into_response();
    }
    let body = match proxy::read_body(&state.config, headers, body, SHAPE).await {
        Ok(body) => body,
        Err(e) => return e.into_response(),
    };
    let Some(route) = Route::of_method(router_path, "generateContent") else {
        return ApiError::not_found(SHAPE, "no Gemini route here").into_response();
    };
    let Some((backend, rewritten)) = proxy::choose_backend(&state.config, route, Some(model))
    else {
        return ApiError::bad_request(
            SHAPE,
            "no_backend",
            format!("no backend serves Gemini model {model:?}"),
        )
        .into_response();
    };
    let body = match rewritten.as_deref() {
        Some(to) if to != model => with_body_model_rewritten(body, model, to),
        _ => body,
    };
    let model = rewritten.as_deref().unwrap_or(model);
    let path = route
        .upstream_path(Some(model))
        .replace(":generateContent", &format!(":{method}"));
    let forwarded = passthrough::client_headers(headers, SHAPE);
    passthrough::relay(
        &state,
        &backend,
        SHAPE,
        Method::POST,
        &path,
        forwarded,
        body,
    )
    .await
}

/// The body's own names of the path's model `from` — an `embedContent`'s `model`, each
/// `requests[].model` of a `batchEmbedContents` (google-genai writes `models/<the model it was
/// given>` there) — as `models/<to>`, the model the path was rewritten to: Google refuses a
/// request naming a model other than its path's, so an alias would otherwise work for
/// `generateContent` and fail for embeddings (decision 91). Other bodies pass as they are.
fn with_body_model_rewritten(body: Bytes, from: &str, to: &str) -> Bytes {
    let Ok(mut value) = serde_json::from_slice::<Value>(&body) else {
        return body;
    };
    let mut changed = false;
    let mut rewrite = |model: Option<&mut Value>| {
        if let Some(model) = model
            && model
                .as_str()
                .is_some_and(|m| m.strip_prefix("models/").unwrap_or(m) == from)
        {
            *model = Value::String(format!("models/{to}"));
            changed = true;
        }
    };
    rewrite(value.get_mut("model"));
    if let Some(requests) = value.get_mut("requests").and_then(Value::as_array_mut) {
        for request in requests {
            rewrite(request.get_mut("model"));
        }
    }
    if !changed {
        return body;
    }
    serde_json::to_vec(&value).map_or(body, Bytes::from)
}

/// `?key=KEY`, the Gemini API's other way to send a key, taken as `x-goog-api-key` when that
/// header is absent: a namespace key like any other (GM-2), never forwarded (the upstream URL
/// is built from the route, without the client's query).
pub(super) fn key_from_query(uri: &Uri, headers: &mut HeaderMap) {
    if headers.contains_key(SHAPE.credential_header()) {
        return;
    }
    let key = query_of(uri).remove("key");
    if let Some(value) = key.and_then(|k| HeaderValue::from_str(&k).ok()) {
        headers.insert(SHAPE.credential_header(), value);
    }
}

/// Whether the query asks for server-sent events (`alt=sse`).
fn asks_for_sse(uri: &Uri) -> bool {
    query_of(uri).get("alt").is_some_and(|alt| alt == "sse")
}

/// The query's parameters, decoded (the last of a repeated name); none when it cannot be read.
fn query_of(uri: &Uri) -> HashMap<String, String> {
    Query::<HashMap<String, String>>::try_from_uri(uri).map_or_else(|_| HashMap::new(), |q| q.0)
}

fn no_route(uri: &Uri) -> Response {
    ApiError::not_found(SHAPE, format!("holdfast has no route {}", uri.path())).into_response()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// Decision 91: a batch's `requests[].model` (and an `embedContent`'s `model`) naming the
    /// path's alias follow the path to the rewritten model; another name, or a body that is
    /// not JSON, is left as it came.
    #[test]
    fn an_embedding_bodys_model_follows_the_paths_rewrite_gm4() {
        let batch = json!({"requests": [
            {"model": "models/embed-fast", "content": {"parts": [{"text": "a"}]}},
            {"model": "embed-fast", "content": {"parts": [{"text": "b"}]}},
            {"model": "models/other", "content": {"parts": [{"text": "c"}]}},
            {"content": {"parts": [{"text": "d"}]}}]});
        let out = with_body_model_rewritten(
            Bytes::from(batch.to_string()),
            "embed-fast",
            "text-embedding-004",
        );
        let out: Value = serde_json::from_slice(&out).unwrap();
        let models: Vec<&Value> = out["requests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| &r["model"])
            .collect();
        assert_eq!(
            models,
            [
                &json!("models/text-embedding-004"),
                &json!("models/text-embedding-004"),
                &json!("models/other"),
                &Value::Null,
            ]
        );
        let one = json!({"model": "models/embed-fast", "content": {"parts": [{"text": "a"}]}});
        let out = with_body_model_rewritten(Bytes::from(one.to_string()), "embed-fast", "e-4");
        let out: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(out["model"], "models/e-4");
        for untouched in [r#"{"contents":[]}"#, "not json", r#"{"model":5}"#] {
            let out = with_body_model_rewritten(Bytes::from(untouched), "embed-fast", "e-4");
            assert_eq!(&out[..], untouched.as_bytes());
        }
    }
}
