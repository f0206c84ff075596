//! The web page's HTTP side (docs/ui.md), without a browser: `/ui` is off by default and then
//! indistinguishable from an unknown path; on, its assets carry the security headers; the event
//! stream of `GET /requests/{id}` takes the key as `?key=` (an `EventSource` cannot send headers)
//! and nothing else does. The page itself is driven by Chromium in `browser::ui`.

use holdfast::mock::MockConfig;

use crate::helpers::*;

const ASSETS: [(&str, &str); 4] = [
    ("/ui", "text/html; charset=utf-8"),
    ("/ui/app.js", "text/javascript; charset=utf-8"),
    ("/ui/app.css", "text/css; charset=utf-8"),
    ("/ui/favicon.svg", "image/svg+xml"),
];

/// (status, `Holdfast-Error`, body) of `method url`.
async fn answer(http: &reqwest::Client, method: &str, url: &str) -> (u16, String, String) {
    let response = http
        .request(method.parse().unwrap(), url)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let code = header(&response, "holdfast-error");
    (status, code, response.text().await.unwrap())
}

#[tokio::test]
async fn ui_is_off_by_default_and_then_answers_exactly_as_an_unknown_path() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    for (path, _) in ASSETS {
        for method in ["GET", "HEAD", "POST", "DELETE"] {
            let unknown = format!("{path}-unknown");
            let (status, code, body) =
                answer(&app.http, method, &format!("{}{path}", app.base)).await;
            let (u_status, u_code, u_body) =
                answer(&app.http, method, &format!("{}{unknown}", app.base)).await;
            assert_eq!(status, 404, "{method} {path} with ui off");
            assert_eq!(
                (status, code.as_str()),
                (u_status, u_code.as_str()),
                "{method} {path}"
            );
            assert_eq!(
                body,
                u_body.replace(&unknown, path),
                "{method} {path}: same body"
            );
        }
    }
    app.stop().await;
}

#[tokio::test]
async fn ui_assets_carry_a_strict_csp_nosniff_and_no_cookie() {
    let app = spawn_app(MockConfig::default(), |c| c.ui = true).await;
    for (path, content_type) in ASSETS {
        let r = app
            .http
            .get(format!("{}{path}", app.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
        assert_eq!(header(&r, "content-type"), content_type, "{path}");
        let csp = header(&r, "content-security-policy");
        for directive in [
            "default-src 'self'",
            "script-src 'self'",
            "style-src 'self'",
            "connect-src 'self'",
            "object-src 'none'",
            "frame-ancestors 'none'",
        ] {
            assert!(csp.contains(directive), "{path}: {directive} in {csp:?}");
        }
        assert!(
            !csp.contains("unsafe-inline") && !csp.contains("unsafe-eval") && !csp.contains('*'),
            "{path}: nothing inline, no eval, no wildcard: {csp:?}"
        );
        assert_eq!(header(&r, "x-content-type-options"), "nosniff", "{path}");
        assert_eq!(header(&r, "referrer-policy"), "no-referrer", "{path}");
        assert!(r.headers().get("set-cookie").is_none(), "{path}: no cookie");
        let body = r.text().await.unwrap();
        assert!(!body.is_empty(), "{path}");
        if path == "/ui" {
            // Script and style come from their own files: the page has no inline script, no
            // inline style and no inline event handler for the CSP to have to allow.
            assert!(body.contains(r#"<script src="/ui/app.js" defer></script>"#));
            assert_eq!(body.matches("<script").count(), 1, "one script element");
            assert!(!body.contains("<style") && !body.contains("style="));
            assert!(no_handlers(&body), "no inline event handler");
        }
        if path == "/ui/app.js" {
            for sink in [
                "innerHTML",
                "outerHTML",
                "insertAdjacentHTML",
                "document.write",
            ] {
                let uses = body
                    .lines()
                    .filter(|l| !l.trim_start().starts_with("//"))
                    .any(|l| l.contains(sink));
                assert!(!uses, "app.js uses {sink}");
            }
        }
    }
    let post = answer(&app.http, "POST", &format!("{}/ui", app.base)).await;
    assert_eq!(post.0, 405, "a known path with another method");
    app.stop().await;
}

/// Whether no tag of `html` has an `on...=` attribute.
fn no_handlers(html: &str) -> bool {
    html.split('<').skip(1).all(|tag| {
        let tag = tag.split('>').next().unwrap_or_default();
        !tag.split_whitespace()
            .skip(1)
            .any(|attr| attr.to_ascii_lowercase().starts_with("on") && attr.contains('='))
    })
}

fn two_tenants(c: &mut holdfast::config::Config) {
    c.namespaces = two_namespaces("team-a", "team-b");
    c.admin_api_keys = vec!["key-admin".into()];
    c.ui = true;
}

#[tokio::test]
async fn event_stream_takes_the_key_as_a_query_parameter_and_nothing_else_does() {
    let app = spawn_app(MockConfig::default(), two_tenants).await;
    let a = app
        .post(
            "/v1/chat/completions",
            chat_body("query key"),
            &[("authorization", "Bearer key-a")],
        )
        .await;
    assert_eq!(a.status(), 200);
    let id = header(&a, "holdfast-request-id");
    let events = |query: &str, headers: &[(&'static str, &'static str)]| {
        let mut req = app
            .http
            .get(format!("{}/requests/{id}{query}", app.base))
            .header("accept", "text/event-stream");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.send()
    };

    // The namespace's key and an admin key read the stream; it ends with `end`.
    for key in ["key-a", "key-admin"] {
        let r = events(&format!("?key={key}"), &[]).await.unwrap();
        assert_eq!(r.status(), 200, "{key}");
        let (_, got) = read_events(r).await;
        assert_eq!(got.last().unwrap().event.as_deref(), Some("end"), "{key}");
    }
    // With a resume position in the query too (what the page's own reconnect sends).
    let r = events("?key=key-a&last_event_id=0", &[]).await.unwrap();
    assert_eq!(r.status(), 200);
    // Another namespace's key: 404, as with a header; an unknown or empty key: 401.
    assert_eq!(events("?key=key-b", &[]).await.unwrap().status(), 404);
    assert_eq!(events("?key=key-c", &[]).await.unwrap().status(), 401);
    assert_eq!(events("?key=", &[]).await.unwrap().status(), 401);
    assert_eq!(events("?key=key-a%20", &[]).await.unwrap().status(), 200);
    // A key header wins over the query parameter, both ways.
    let wrong_header = [("authorization", "Bearer key-c")];
    assert_eq!(
        events("?key=key-a", &wrong_header).await.unwrap().status(),
        401
    );
    let right_header = [("x-api-key", "key-a")];
    assert_eq!(
        events("?key=key-c", &right_header).await.unwrap().status(),
        200
    );

    // The JSON record refuses the parameter, whatever the key: keys go in headers there.
    for query in ["?key=key-a", "?key=key-c"] {
        let r = app
            .http
            .get(format!("{}/requests/{id}{query}", app.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{query}");
        assert_eq!(header(&r, "holdfast-error"), "invalid_parameter");
        assert!(r.text().await.unwrap().contains("key"));
    }
    // The other log routes do not take it either.
    for path in [
        "/requests?key=key-a".to_string(),
        "/usage?key=key-a".to_string(),
    ] {
        let r = app
            .http
            .get(format!("{}{path}", app.base))
            .send()
            .await
            .unwrap();
        assert_ne!(r.status(), 200, "{path}");
    }
    let cancel = app
        .http
        .post(format!("{}/requests/{id}/cancel?key=key-a", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(cancel.status(), 401, "cancel takes no query key");
    app.stop().await;
}

/// The page's route filter offers every route of the route table (a new provider's included).
#[tokio::test]
async fn the_pages_route_filter_offers_every_route() {
    let app = spawn_app(MockConfig::default(), |c| c.ui = true).await;
    let (status, _, page) = answer(&app.http, "GET", &format!("{}/ui", app.base)).await;
    assert_eq!(status, 200);
    for route in holdfast::provider::Route::ALL {
        assert!(
            page.contains(&format!("<option>{}</option>", route.name())),
            "the route filter lacks {}",
            route.name()
        );
    }
    app.stop().await;
}
