//! Callbacks at the HTTP surface (SPEC CB-1, CB-2, CB-3, CB-6): the `Holdfast-Callback-Url`
//! admission check, the webhook body (the record as `GET /requests/{id}` shows it), and the
//! `callback` member of records.

use std::sync::Arc;

use axum::http::HeaderMap;
use serde_json::{Value, json};

use super::errors::ApiError;
use super::requests::{RecordView, bodies_and_text, rfc3339};
use crate::callback::{Allow, Render, Webhook, check_url};
use crate::config::Config;
use crate::provider::Provider;
use crate::store::{Callback, CallbackState, DynStore, RequestRecord, Status};

/// The header a caller names its callback URL in (CB-1).
pub(super) const CALLBACK_HEADER: &str = "holdfast-callback-url";

/// The callback URL a submission of `namespace` records (CB-1): its header's, else the
/// namespace's default, checked (CB-2).
///
/// # Errors
/// 400 `invalid_callback_url` in `shape`'s error shape: a URL CB-2 refuses, or any callback
/// when the namespace has no signing secret.
pub(super) fn requested(
    config: &Config,
    headers: &HeaderMap,
    namespace: &str,
    shape: Provider,
) -> Result<Option<String>, ApiError> {
    let settings = config.callbacks_of(namespace);
    let bad = |why: String| {
        ApiError::bad_request(
            shape,
            "invalid_callback_url",
            format!("{CALLBACK_HEADER}: {why}"),
        )
    };
    let url = match headers.get(CALLBACK_HEADER) {
        Some(value) => value
            .to_str()
            .map_err(|_| bad("not a visible-ASCII URL".into()))?
            .trim()
            .to_string(),
        None => match settings.url {
            Some(url) => url.to_string(),
            None => return Ok(None),
        },
    };
    if settings.secrets.is_empty() {
        return Err(bad(
            "callbacks need a signing secret, and none is configured for this namespace \
             ([callbacks] secrets)"
                .into(),
        ));
    }
    check_url(&url, &Allow::new(&config.callbacks.allow)).map_err(|e| bad(e.to_string()))?;
    Ok(Some(url))
}

/// The webhook renderer of the deliverer (CB-3): `{"type", "timestamp", "data"}`, `data` the
/// record as `GET /requests/{id}` answers it (with `request`, `answer` and `answer_text`, as
/// `?include=body` adds them, when the namespace includes bodies), without its `callback`
/// member.
pub(crate) fn renderer(store: DynStore, config: Arc<Config>) -> Render {
    Arc::new(move |id| {
        let (store, config) = (store.clone(), Arc::clone(&config));
        Box::pin(async move {
            let Some(record) = store.get_any(id).await? else {
                return Ok(None);
            };
            let by_attempt = store.attempt_usage(id).await?;
            let view = RecordView::new(&record, &config, Some(by_attempt));
            let mut data = serde_json::to_value(view).unwrap_or_default();
            if config.callbacks_of(&record.namespace).include_body {
                let (request, answer, text) = bodies_and_text(&store, &record, true).await?;
                if let Some(object) = data.as_object_mut() {
                    object.insert("request".into(), request);
                    object.insert("answer".into(), answer);
                    object.insert("answer_text".into(), json!(text));
                }
            }
            let kind = match record.status {
                Status::Succeeded => "request.succeeded",
                _ => "request.failed",
            };
            let body = json!({
                "type": kind,
                "timestamp": rfc3339(record.finished_at.unwrap_or(record.updated_at)),
                "data": data,
            });
            Ok(Some(Webhook {
                namespace: record.namespace,
                body: serde_json::to_vec(&body).unwrap_or_default(),
            }))
        })
    })
}

/// The `callback` member of `record`'s JSON (CB-6): `null` without one.
pub(super) fn view(callback: Option<&Callback>, record: &RequestRecord) -> Value {
    let Some(c) = callback else {
        return Value::Null;
    };
    let due = c.state == CallbackState::Pending && record.status.is_terminal();
    json!({
        "url": c.url,
        "state": c.state,
        "attempts": c.attempts,
        "last_status": c.last_status,
        "last_error": c.last_error,
        "next_try_at": due.then(|| rfc3339(c.next_try_at.max(record.finished_at.unwrap_or(0)))),
        "delivered_at": c.delivered_at.map(rfc3339),
    })
}

/// The record JSON of `view` (made from `record`) with its `callback` member (CB-6): what every
/// answer that carries "the record" shows, as `GET /requests/{id}` does.
pub(super) async fn record_value(
    store: &DynStore,
    record: &RequestRecord,
    view: RecordView,
) -> Result<Value, crate::store::StoreError> {
    let mut value = serde_json::to_value(view).unwrap_or_default();
    add_views(
        store,
        std::slice::from_ref(record),
        std::slice::from_mut(&mut value),
    )
    .await?;
    Ok(value)
}

/// Adds the `callback` member to each record JSON of `values` (objects with an `id`), reading
/// the callbacks of `records` at once.
pub(super) async fn add_views(
    store: &DynStore,
    records: &[RequestRecord],
    values: &mut [Value],
) -> Result<(), crate::store::StoreError> {
    let ids: Vec<uuid::Uuid> = records.iter().map(|r| r.id).collect();
    let callbacks = store.callbacks(&ids).await?;
    for (record, value) in records.iter().zip(values.iter_mut()) {
        let callback = callbacks.iter().find(|c| c.request_id == record.id);
        if let Some(object) = value.as_object_mut() {
            object.insert("callback".into(), view(callback, record));
        }
    }
    Ok(())
}
