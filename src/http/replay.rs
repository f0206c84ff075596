//! `POST /requests/{id}/replay`: a stored request sent again as a new request, linked to the
//! original by `replay_of` (EX-7, EX-8, decision 64).

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::Value;
use uuid::Uuid;

use super::errors::ApiError;
use super::proxy::{choose_backend, request_hash};
use super::requests::{RecordView, addressed, bad_parameter};
use super::{AppState, presented_key};
use crate::canonical;
use crate::provider::{Provider, Route};
use crate::store::{ClaimKind, NewRequest, RequestRecord, StoreError, Submitted, now_ms};

/// What the caller asked to change: the model, the backend (both optional).
struct Asked {
    model: Option<String>,
    backend: Option<String>,
}

/// The JSON body: `{}`, `{"model"}`, `{"backend"}` or both; no body at all is `{}`.
fn asked(body: &[u8]) -> Result<Asked, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Asked {
            model: None,
            backend: None,
        });
    }
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| bad_parameter("body", format!("not JSON: {e}")))?;
    let object = value
        .as_object()
        .ok_or_else(|| bad_parameter("body", "must be a JSON object"))?;
    let text = |name: &str| -> Result<Option<String>, ApiError> {
        match object.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
            Some(_) => Err(bad_parameter(name, "must be a non-empty string")),
        }
    };
    if let Some(other) = object.keys().find(|k| *k != "model" && *k != "backend") {
        return Err(bad_parameter(
            other,
            "unknown member; known: model, backend",
        ));
    }
    Ok(Asked {
        model: text("model")?,
        backend: text("backend")?,
    })
}

/// `POST /requests/{id}/replay` (EX-7): 201 with the new record while it runs.
pub(super) async fn replay(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let record = match replay_of(&state, &headers, &id, &body).await {
        Ok(record) => record,
        Err(e) => return e.into_response(),
    };
    // The record as `GET /requests/{id}` shows it, with its callback (CB-6).
    let view = RecordView::new(&record, &state.config, None);
    let value = match super::callbacks::record_value(&state.store, &record, view).await {
        Ok(value) => value,
        Err(e) => return ApiError::store(Provider::Openai, &e).into_response(),
    };
    let mut response = (StatusCode::CREATED, axum::Json(value)).into_response();
    if let Ok(v) = HeaderValue::from_str(&format!("/requests/{}", record.id)) {
        response.headers_mut().insert(header::LOCATION, v);
    }
    if let Ok(v) = HeaderValue::from_str(&record.id.to_string()) {
        response.headers_mut().insert(super::REQUEST_ID, v);
    }
    response
}

async fn replay_of(
    state: &AppState,
    headers: &HeaderMap,
    id: &str,
    body: &[u8],
) -> Result<RequestRecord, ApiError> {
    let shape = Provider::Openai;
    let original = addressed(state, presented_key(headers), id).await?;
    let asked = asked(body)?;
    let new = new_request(state, &original, asked)?;
    match state.workers.admit(new).await {
        Ok(Submitted::Created(record)) => Ok(*record),
        // A claim key no send can form (decision 64): neither can happen.
        Ok(Submitted::Attached(_) | Submitted::KeyMismatch { .. }) => Err(ApiError::new(
            shape,
            StatusCode::CONFLICT,
            "replay_conflict",
            "the replay's claim was taken; send it again",
        )),
        // No later send can attach to a replay (its claim is its own), and on PostgreSQL a
        // recording past its deadline may still commit and run: not "retry", which would pay
        // twice, but look first (EX-7a, decision 168).
        Err(e @ StoreError::Unavailable(_)) => {
            tracing::error!(error = %e, original = %original.id, "store unavailable for a replay");
            Err(ApiError::new(
                shape,
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unavailable",
                format!(
                    "holdfast's database failed or did not answer in time; the replay may still \
                     have been recorded and run: look for it with GET /requests?replay_of={} \
                     before replaying again",
                    original.id
                ),
            )
            .final_answer())
        }
        Err(e) => Err(ApiError::store(shape, &e)),
    }
}

/// The replay of `original` as a new request (EX-7, decision 64).
fn new_request(
    state: &AppState,
    original: &RequestRecord,
    asked: Asked,
) -> Result<NewRequest, ApiError> {
    let config = &state.config;
    let route = original.route;
    let serves_route = |name: &str| {
        config
            .backend(name)
            .is_some_and(|b| b.kind == route.provider())
    };
    let (backend, model) = match (asked.backend, asked.model) {
        // The original's backend may have been removed or renamed since (decision 86).
        (None, None) if !serves_route(&original.backend) => {
            return Err(bad_parameter(
                "backend",
                format!(
                    "the original's backend {:?} is no longer a configured backend serving {}; \
                     name a `backend` or a `model` to replay it with",
                    original.backend,
                    route.name()
                ),
            ));
        }
        (None, None) => (original.backend.clone(), original.model.clone()),
        (Some(backend), model) => {
            if !serves_route(&backend) {
                return Err(bad_parameter(
                    "backend",
                    format!(
                        "{backend:?} is not a configured backend serving {}",
                        route.name()
                    ),
                ));
            }
            (backend, model.or_else(|| original.model.clone()))
        }
        (None, Some(model)) => {
            let (backend, upstream) =
                choose_backend(config, route, Some(&model)).ok_or_else(|| {
                    bad_parameter(
                        "model",
                        format!("no backend serves {} for {model:?}", route.name()),
                    )
                })?;
            (backend, Some(upstream.unwrap_or(model)))
        }
    };
    // GM-1 (decision 153): a model named in the path is one segment of what a client's call
    // may name there, whoever chose it: else it could name another path or method on the
    // backend, sent with the backend's key.
    if route.model_in_path()
        && let Some(model) = model.as_deref()
        && !Route::is_path_model(model)
    {
        return Err(bad_parameter(
            "model",
            format!(
                "{model:?} cannot be a Gemini model: it must be letters, digits, `.`, `-` or `_` \
                 (at most 256)"
            ),
        ));
    }
    let canonical = canonical::canonicalize(&original.body)
        .map_err(|e| bad_parameter("id", format!("the stored body cannot be read: {e:?}")))?;
    // ID-3b: only the model string changes, in place; a path's model is not in the body.
    let (body, hashed) = match (&model, &canonical.model_span, route.model_in_path()) {
        (Some(model), Some(span), false) if canonical.model.as_deref() != Some(model) => (
            canonical::rewrite_model(&original.body, span.clone(), model),
            canonical.with_model(model),
        ),
        (Some(model), None, false) if original.model.as_deref() != Some(model) => {
            return Err(bad_parameter(
                "model",
                "the stored body names no model to replace",
            ));
        }
        _ => (original.body.clone(), canonical.bytes.clone()),
    };
    let hash = request_hash(
        route,
        &backend,
        &original.headers,
        &hashed,
        model.as_deref(),
    );
    let id = Uuid::now_v7();
    let now = now_ms();
    let window = i64::try_from(config.dedupe_window_secs.saturating_mul(1000)).unwrap_or(i64::MAX);
    Ok(NewRequest {
        id,
        namespace: original.namespace.clone(),
        route,
        backend,
        model,
        stream: original.stream,
        body,
        headers: original.headers.clone(),
        hash,
        // A claim of its own that no client send can form (decision 64).
        claim: ClaimKind::Key,
        claim_key: format!("replay {id}"),
        claim_expires_at: now.saturating_add(window),
        now,
        // Not the original's: that call's trace and callback are its own (OT-2, CB-1).
        trace_parent: None,
        callback_url: None,
        replay_of: Some(original.id),
    })
}
