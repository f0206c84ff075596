//! `GET /openapi.json` against the real router: the document is OpenAPI 3.1-shaped, every
//! operation in it is served, and every route in `holdfast::openapi_routes()` (the table the
//! router is built from) is both
//! documented and served.

use std::collections::BTreeSet;

use holdfast::mock::MockConfig;
use holdfast::provider::Route;
use serde_json::Value;

use crate::helpers::*;

const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

/// (METHOD, path) of every operation in the document.
fn documented(doc: &Value) -> BTreeSet<(String, String)> {
    let paths = doc["paths"].as_object().expect("paths is an object");
    let mut out = BTreeSet::new();
    for (path, item) in paths {
        let item = item.as_object().expect("path item is an object");
        for method in item.keys().filter(|k| METHODS.contains(&k.as_str())) {
            out.insert((method.to_uppercase(), path.clone()));
        }
    }
    out
}

/// How the server answered a call: served by a handler, or by the 404 / 405 fallbacks.
#[derive(Debug, PartialEq)]
enum Answer {
    Served(u16),
    FallbackNotFound,
    MethodNotAllowed,
}

/// Calls `method path` (with `{id}` replaced) and classifies the answer. Proxied routes get a
/// body that is not JSON: their handler refuses it with 400 before recording anything, which
/// proves the route is routed without calling the provider.
async fn call(app: &TestApp, method: &str, path: &str, id: &str) -> Answer {
    let url = format!("{}{}", app.base, path.replace("{id}", id));
    let request = match method {
        "GET" => app.http.get(&url),
        "POST" if path.starts_with("/v1/") => app
            .http
            .post(&url)
            .header("content-type", "application/json")
            .body("not json"),
        "POST" => app.http.post(&url),
        other => app.http.request(other.parse().expect("method"), &url),
    };
    let response = request.send().await.expect("call");
    let status = response.status().as_u16();
    let code = header(&response, "holdfast-error");
    let body = response.text().await.unwrap_or_default();
    match (status, code.as_str()) {
        (404, "not_found") if body.contains("holdfast has no route") => Answer::FallbackNotFound,
        (405, _) => Answer::MethodNotAllowed,
        _ => Answer::Served(status),
    }
}

async fn fetch_document(app: &TestApp) -> Value {
    let response = app
        .http
        .get(format!("{}/openapi.json", app.base))
        .send()
        .await
        .expect("GET /openapi.json");
    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "content-type"), "application/json");
    let text = response.text().await.expect("body");
    serde_json::from_str(&text).expect("/openapi.json is JSON")
}

/// Every `$ref` in `value` points at something that exists in `doc`.
fn assert_refs_resolve(doc: &Value, value: &Value) {
    match value {
        Value::Object(map) => {
            if let Some(Value::String(target)) = map.get("$ref") {
                let pointer = target
                    .strip_prefix('#')
                    .unwrap_or_else(|| panic!("non-local $ref {target}"));
                assert!(doc.pointer(pointer).is_some(), "dangling $ref {target}");
            }
            map.values().for_each(|v| assert_refs_resolve(doc, v));
        }
        Value::Array(items) => items.iter().for_each(|v| assert_refs_resolve(doc, v)),
        _ => {}
    }
}

#[tokio::test]
async fn openapi_document_is_3_1_and_every_operation_in_it_is_served() {
    // `ui = true`: the web page's routes answer 404 themselves when it is off (tests/api/ui.rs).
    let app = spawn_app(MockConfig::default(), |c| c.ui = true).await;
    let fresh = app.chat(&chat_body("openapi check")).await;
    assert_eq!(fresh.status(), 200);
    let id = header(&fresh, "holdfast-request-id");

    let doc = fetch_document(&app).await;
    assert!(
        doc["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.1.")),
        "openapi: {}",
        doc["openapi"]
    );
    assert!(doc["info"]["title"].is_string(), "info.title");
    assert!(doc["info"]["version"].is_string(), "info.version");
    assert_refs_resolve(&doc, &doc);
    let operations = documented(&doc);
    assert!(!operations.is_empty(), "no operations in paths");
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (m, op) in path_ops(item) {
            assert!(
                op["responses"].as_object().is_some_and(|r| !r.is_empty()),
                "{m} {path}: no responses"
            );
        }
    }

    for (method, path) in &operations {
        let answer = call(&app, method, path, &id).await;
        assert!(
            matches!(answer, Answer::Served(_)),
            "{method} {path} is documented but the router answers {answer:?}"
        );
    }
    app.stop().await;
}

/// The operations of one path item, as (method, operation).
fn path_ops(item: &Value) -> Vec<(&str, &Value)> {
    item.as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, _)| METHODS.contains(&k.as_str()))
                .map(|(k, v)| (k.as_str(), v))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn every_router_route_is_documented_and_served_and_the_check_can_fail() {
    // `ui = true`: the web page's routes answer 404 themselves when it is off (tests/api/ui.rs).
    let app = spawn_app(MockConfig::default(), |c| c.ui = true).await;
    let fresh = app.chat(&chat_body("openapi routes")).await;
    let id = header(&fresh, "holdfast-request-id");
    let doc = fetch_document(&app).await;
    let operations = documented(&doc);

    let routes = holdfast::openapi_routes();
    let listed: BTreeSet<(String, String)> = routes
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    assert_eq!(listed.len(), routes.len(), "ROUTES has duplicates");
    for route in Route::ALL {
        assert!(
            listed.contains(&("POST".to_string(), route.client_path().to_string())),
            "ROUTES lacks proxied route {}",
            route.client_path()
        );
    }
    for (method, path) in &routes {
        assert!(
            operations.contains(&(method.to_string(), path.to_string())),
            "{method} {path} is served but not in /openapi.json"
        );
        let answer = call(&app, method, path, &id).await;
        assert!(
            matches!(answer, Answer::Served(_)),
            "{method} {path} is in ROUTES but the router answers {answer:?}"
        );
    }
    assert_eq!(
        operations, listed,
        "/openapi.json and ROUTES describe different sets of routes"
    );

    // The classification can fail: a made-up path and a wrong method are told apart.
    assert_eq!(
        call(&app, "GET", "/v1/made-up-route", &id).await,
        Answer::FallbackNotFound
    );
    assert_eq!(
        call(&app, "POST", "/requests/{id}/nonsense", &id).await,
        Answer::FallbackNotFound
    );
    assert_eq!(
        call(&app, "GET", "/v1/chat/completions", &id).await,
        Answer::MethodNotAllowed
    );
    assert_eq!(
        call(&app, "DELETE", "/requests/{id}", &id).await,
        Answer::MethodNotAllowed
    );
    app.stop().await;
}

/// Every response header holdfast sets on a proxied route is documented in `/openapi.json`
/// (components.headers) and named on that route's responses: headers are collected from real
/// answers — a new request, a replay, `Prefer: respond-async`, a key reused with another body,
/// an overload refusal, a replayed provider refusal and a failure.
#[tokio::test]
async fn every_response_header_holdfast_sets_is_documented() {
    let app = spawn_app(MockConfig::default(), |c| c.workers.max_attempts = 1).await;
    let doc: Value = app
        .http
        .get(format!("{}/openapi.json", app.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let components: BTreeSet<String> = doc["components"]["headers"]
        .as_object()
        .expect("components.headers")
        .keys()
        .map(|k| k.to_ascii_lowercase())
        .collect();
    let named_on_routes: BTreeSet<String> = doc["paths"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(path, _)| path.starts_with("/v1/"))
        .flat_map(|(_, item)| item.as_object().unwrap().values())
        .flat_map(|op| op["responses"].as_object().into_iter().flatten())
        .map(|(_, r)| match r["$ref"].as_str() {
            // A shared response: "#/components/responses/<name>".
            Some(target) => &doc["components"]["responses"][target.rsplit('/').next().unwrap()],
            None => r,
        })
        .flat_map(|r| r["headers"].as_object().into_iter().flatten())
        .map(|(name, _)| name.to_ascii_lowercase())
        .collect();

    let mut seen: BTreeSet<String> = BTreeSet::new();
    let mut collect = |r: &reqwest::Response| {
        seen.extend(r.headers().keys().map(|k| k.as_str().to_string()));
    };
    let body = chat_body("headers");
    collect(&app.chat(&body).await);
    collect(&app.chat(&body).await);
    collect(
        &app.post(
            "/v1/chat/completions",
            chat_body("async headers"),
            &[("prefer", "respond-async")],
        )
        .await,
    );
    collect(
        &app.post(
            "/v1/messages",
            r#"{"model":"m","max_tokens":1,"messages":[]}"#,
            &[],
        )
        .await,
    );
    let key = [("idempotency-key", "k-1")];
    collect(&app.post("/v1/chat/completions", chat_body("a"), &key).await);
    collect(&app.post("/v1/chat/completions", chat_body("b"), &key).await);
    app.mock.set_config(MockConfig {
        fail_first: 1,
        fail_status: 400,
        ..MockConfig::default()
    });
    collect(&app.chat(&chat_body("refused")).await);
    app.mock.set_config(MockConfig {
        fail_first: 1,
        fail_status: 500,
        ..MockConfig::default()
    });
    collect(&app.chat(&chat_body("failed")).await);
    collect(&app.post("/v1/chat/completions", "not json", &[]).await);

    // Standard HTTP headers, not holdfast's to document.
    let standard = [
        "content-type",
        "content-length",
        "date",
        "cache-control",
        "x-accel-buffering",
        "transfer-encoding",
        "vary",
    ];
    let ours: Vec<&String> = seen
        .iter()
        .filter(|h| !standard.contains(&h.as_str()))
        .collect();
    for must in ["holdfast-claim-expires-at", "location", "holdfast-error"] {
        assert!(
            ours.iter().any(|h| *h == must),
            "{must} was exercised: {ours:?}"
        );
    }
    for header in ours {
        assert!(
            components.contains(header),
            "{header} is in components.headers"
        );
        assert!(
            named_on_routes.contains(header),
            "{header} is named on the proxied routes' responses"
        );
    }
    app.stop().await;
}
