//! Streams: numbered chunks, attach, live tail, replay and resume (RS-2..RS-4, LC-7, RD-2..RD-6).

use std::time::Duration;

use futures::future::join_all;
use holdfast::mock::MockConfig;
use rand::Rng;

use crate::helpers::*;

#[tokio::test]
async fn proxied_stream_is_the_providers_events_and_a_repeat_replays_them_rs3_rs4() {
    let app = spawn_app(
        MockConfig {
            chunks: 12,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let body = stream_body("stream me");
    let first = app.chat(&body).await;
    assert_eq!(first.status(), 200);
    assert!(header(&first, "content-type").starts_with("text/event-stream"));
    assert_eq!(header(&first, "idempotent-replayed"), "false");
    let id = header(&first, "holdfast-request-id");
    assert!(
        header(&first, "x-request-id").starts_with("req_mock_"),
        "RS-5"
    );
    let (raw, events) = read_events(first).await;
    assert!(
        !raw.lines().any(|l| l.starts_with("id:")),
        "RS-4: no id lines on proxied routes"
    );
    assert_eq!(events.last().unwrap().data, "[DONE]");
    assert!(openai_text(&events).starts_with("mock reply"));

    let again = app.chat(&body).await;
    assert_eq!(header(&again, "idempotent-replayed"), "true");
    assert_eq!(header(&again, "holdfast-request-id"), id);
    let (raw_again, _) = read_events(again).await;
    assert_eq!(raw_again, raw, "RS-3: the identical sequence");
    assert_eq!(app.mock.calls(), 1);

    let record = app.record(&id).await;
    assert_eq!(record["status"], "succeeded");
    assert_eq!(record["stream"], true);
    assert_eq!(
        record["last_seq"].as_i64().unwrap(),
        events.len() as i64 + 1,
        "data chunks + end"
    );
    app.stop().await;
}

#[tokio::test]
async fn thirty_readers_attaching_at_random_moments_each_get_the_full_sequence_rs2_rd4() {
    let app = spawn_app(
        MockConfig {
            chunks: 200,
            chunk_delay_ms: 5,
            header_delay_ms: 100,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let body = stream_body("two hundred chunks");
    let submitter = app.chat(&body).await;
    let id = header(&submitter, "holdfast-request-id");
    let mut delays: Vec<u64> = {
        let mut rng = rand::rng();
        (0..30).map(|_| rng.random_range(0..1_600)).collect()
    };
    delays[0] = 0;
    let readers = delays.iter().enumerate().map(|(i, delay)| {
        let app = &app;
        let body = &body;
        let id = &id;
        async move {
            tokio::time::sleep(Duration::from_millis(*delay)).await;
            if i % 2 == 0 {
                // A duplicate submission attaches on the proxied route.
                let r = app.chat(body).await;
                assert_eq!(header(&r, "holdfast-request-id"), *id);
                ("proxied", read_events(r).await.1)
            } else {
                // A log reader without a position gets the current attempt (RD-6).
                let r = get_events(&app.http, &app.base, id, None).await;
                let (_, mut events) = read_events(r).await;
                assert_eq!(events.pop().map(|e| e.event), Some(Some("end".into())));
                ("log", events)
            }
        }
    });
    let (_, submitted) = read_events(submitter).await;
    assert_eq!(submitted.len(), 203, "role + 200 pieces + finish + [DONE]");
    let results = join_all(readers).await;
    for (kind, events) in results {
        let data: Vec<&str> = events.iter().map(|e| e.data.as_str()).collect();
        let expected: Vec<&str> = submitted.iter().map(|e| e.data.as_str()).collect();
        assert_eq!(data, expected, "{kind} reader saw a different sequence");
    }
    assert_eq!(app.mock.calls(), 1);
    app.stop().await;
}

#[tokio::test]
async fn resume_from_every_position_returns_exactly_the_rest_rd3_rd5() {
    let app = spawn_app(
        MockConfig {
            chunks: 6,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let r = app.chat(&stream_body("resume me")).await;
    let id = header(&r, "holdfast-request-id");
    read_events(r).await;
    let record = app.record(&id).await;
    let last = record["last_seq"].as_i64().unwrap();

    let full = get_events(&app.http, &app.base, &id, Some("0")).await;
    assert_eq!(full.status(), 200);
    let (raw, all) = read_events(full).await;
    assert!(raw.starts_with("retry:"), "RD-2 starts with retry");
    let ids: Vec<i64> = all
        .iter()
        .map(|e| e.id.as_deref().unwrap().parse().unwrap())
        .collect();
    assert_eq!(ids, (1..=last).collect::<Vec<_>>());
    assert_eq!(all.last().unwrap().event.as_deref(), Some("end"));
    let end: serde_json::Value = serde_json::from_str(&all.last().unwrap().data).unwrap();
    assert_eq!(end["status"], "succeeded");

    for p in 0..last {
        let r = get_events(&app.http, &app.base, &id, Some(&p.to_string())).await;
        let (_, rest) = read_events(r).await;
        let expected: Vec<_> = all.iter().skip(p as usize).cloned().collect();
        let rest: Vec<_> = rest
            .into_iter()
            .map(|mut e| {
                e.retry = None;
                e
            })
            .collect();
        let expected: Vec<_> = expected
            .into_iter()
            .map(|mut e| {
                e.retry = None;
                e
            })
            .collect();
        assert_eq!(rest, expected, "resume from {p}");
    }
    for at_or_past in [last, last + 5] {
        let r = get_events(&app.http, &app.base, &id, Some(&at_or_past.to_string())).await;
        assert_eq!(r.status(), 204, "RD-5: at or past the end");
    }
    let r = app
        .http
        .get(format!(
            "{}/requests/{id}?last_event_id={}",
            app.base,
            last - 1
        ))
        .header("accept", "text/event-stream")
        .send()
        .await
        .unwrap();
    let (_, rest) = read_events(r).await;
    assert_eq!(rest.len(), 1, "query parameter position (RD-3)");
    // An empty Last-Event-ID header is no position: the query parameter is used.
    let r = app
        .http
        .get(format!(
            "{}/requests/{id}?last_event_id={}",
            app.base,
            last - 2
        ))
        .header("accept", "text/event-stream")
        .header("last-event-id", "")
        .send()
        .await
        .unwrap();
    let (_, rest) = read_events(r).await;
    assert_eq!(
        rest.len(),
        2,
        "empty header, query parameter position (RD-3)"
    );
    // A header with a value wins over the query parameter.
    let r = app
        .http
        .get(format!("{}/requests/{id}?last_event_id=0", app.base))
        .header("accept", "text/event-stream")
        .header("last-event-id", (last - 1).to_string())
        .send()
        .await
        .unwrap();
    let (_, rest) = read_events(r).await;
    assert_eq!(rest.len(), 1, "header position wins (RD-3)");
    for bad in ["abc", "-1", "99999999999999999999999", "1.5"] {
        let r = get_events(&app.http, &app.base, &id, Some(bad)).await;
        assert_eq!(r.status(), 400, "Last-Event-ID {bad}");
    }
    app.stop().await;
}

/// RD-3, RD-5: a position past the last event of a request that is still running is one no
/// reader can have seen (positioned readers see committed chunks only, RD-4): it is refused
/// with 400 `invalid_last_event_id`. Before, the stream stayed open skipping every chunk at or
/// below the position, the `end` included, and never closed, even after the request ended.
/// At the request's last event, the reader follows it to its `end`.
#[tokio::test]
async fn a_position_past_a_running_requests_last_event_is_refused_not_left_open_forever_rd3_rd5() {
    let app = spawn_app(
        MockConfig {
            chunks: 10,
            chunk_delay_ms: 200,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let id = submit_async(&app.http, &app.base, stream_body("past the end")).await;
    let record = app.record(&id).await;
    assert!(
        matches!(record["status"].as_str(), Some("pending" | "running")),
        "{record}"
    );
    let last = record["last_seq"].as_i64().unwrap();
    let past = last + 50;
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        get_events(&app.http, &app.base, &id, Some(&past.to_string())),
    )
    .await
    .expect("answered at once");
    assert_eq!(r.status(), 400, "Last-Event-ID {past} past {last}");
    assert_eq!(header(&r, "holdfast-error"), "invalid_last_event_id");
    // At the last event, the stream follows the request to its end and closes.
    let r = get_events(&app.http, &app.base, &id, Some(&last.to_string())).await;
    assert_eq!(r.status(), 200);
    let (_, rest) = tokio::time::timeout(Duration::from_secs(10), read_events(r))
        .await
        .expect("the stream closes after its end");
    assert_eq!(rest.last().unwrap().event.as_deref(), Some("end"));
    // Ended, the same position past the end is RD-5's 204.
    let r = get_events(&app.http, &app.base, &id, Some(&past.to_string())).await;
    assert_eq!(r.status(), 204);
    app.stop().await;
}

#[tokio::test]
async fn provider_drop_after_five_chunks_fails_stream_interrupted_and_a_resend_gets_the_failure_lc7_id6a()
 {
    let app = spawn_app(
        MockConfig {
            chunks: 20,
            drop_after_chunks: Some(5),
            drop_first: 1,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let body = stream_body("drop me");
    let r = app.chat(&body).await;
    assert_eq!(r.status(), 200);
    let id = header(&r, "holdfast-request-id");
    let (raw, events) = read_events(r).await;
    let last = events.last().unwrap();
    let error: serde_json::Value = serde_json::from_str(&last.data).unwrap();
    assert_eq!(error["error"]["code"], "stream_interrupted", "{raw}");
    assert!(
        !raw.contains("[DONE]"),
        "never a clean [DONE] after a broken stream"
    );
    let record = app.record(&id).await;
    assert_eq!(record["status"], "failed");
    assert_eq!(record["error"]["type"], "stream_interrupted");
    assert_eq!(record["attempts"], 1, "never retried silently");

    // ID-6a: the claim is released a minute after the failure; until then a re-send (an
    // SDK's retry) is the failed request, replayed as it ended, with no provider call.
    let again = app.chat(&body).await;
    assert_eq!(header(&again, "holdfast-request-id"), id);
    let (replayed, again) = read_events(again).await;
    let error: serde_json::Value = serde_json::from_str(&again.last().unwrap().data).unwrap();
    assert_eq!(error["error"]["code"], "stream_interrupted", "{replayed}");
    assert_eq!(again.len(), events.len(), "the same events: {replayed}");
    assert_eq!(app.mock.calls(), 1);
    app.stop().await;
}

#[tokio::test]
async fn stream_refused_before_any_chunk_answers_with_the_provider_status_rs7() {
    let app = spawn_app(
        MockConfig {
            fail_first: 1,
            fail_status: 400,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let r = app.chat(&stream_body("refuse this stream")).await;
    assert_eq!(r.status(), 400);
    assert_eq!(header(&r, "x-should-retry"), "false");
    app.stop().await;
}

#[tokio::test]
async fn transient_failure_before_the_first_chunk_is_retried_lc5() {
    let app = spawn_app(
        MockConfig {
            fail_first: 1,
            fail_status: 503,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let r = app.chat(&stream_body("retry me first")).await;
    assert_eq!(r.status(), 200);
    let id = header(&r, "holdfast-request-id");
    let (_, events) = read_events(r).await;
    assert_eq!(events.last().unwrap().data, "[DONE]");
    assert_eq!(app.record(&id).await["attempts"], 2);
    app.stop().await;
}

#[tokio::test]
async fn malformed_sse_from_the_provider_fails_upstream_invalid_in2() {
    let app = spawn_app(
        MockConfig {
            malformed_sse: true,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let r = app.chat(&stream_body("garbage please")).await;
    let id = header(&r, "holdfast-request-id");
    let _ = r.bytes().await;
    let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(10)).await;
    assert_eq!(record["status"], "failed");
    assert_eq!(record["error"]["type"], "upstream_invalid", "{record}");
    app.stop().await;
}

#[tokio::test]
async fn idle_stream_gets_keepalive_comments_rd2() {
    let app = spawn_app(
        MockConfig {
            chunks: 3,
            chunk_delay_ms: 400,
            ..MockConfig::default()
        },
        |c| c.sse_keepalive_ms = 100,
    )
    .await;
    let r = app.chat(&stream_body("slow stream")).await;
    let (raw, events) = read_events(r).await;
    assert!(raw.contains(": keep-alive"), "{raw}");
    // Each quiet spell gets them, not only the first: after events the reader's one timer
    // (issue 30) is set again.
    let late = raw
        .match_indices(": keep-alive")
        .filter(|(at, _)| raw[..*at].matches("data: ").count() >= 2)
        .count();
    assert!(late >= 1, "keep-alives after the second event: {raw}");
    assert_eq!(events.last().unwrap().data, "[DONE]");
    app.stop().await;
}

/// DU-5: the in-process shutdown ends every connection it holds within the drain bound
/// (`shutdown_grace_ms`, then about 2 s): a log reader of a stream handed back at shutdown, which
/// would otherwise follow the pending request with keep-alives forever, ends without `end` (it
/// resumes elsewhere with its position); the proxied stream ends on an error event, not
/// `[DONE]`; held calls, a non-stream one and a stream one before its first event, answer 503
/// `shutting_down` that SDKs retry. Before the cut (issue 28) only the server task was aborted
/// and each connection, a task of its own, stayed open.
#[tokio::test]
async fn shutdown_ends_log_readers_proxied_streams_and_held_calls_within_the_drain_bound_du5() {
    const GRACE_MS: u64 = 200;
    let app = spawn_app(
        MockConfig {
            // A 20 s stream: it outlives the grace.
            chunks: 400,
            chunk_delay_ms: 50,
            // The first two calls (the held ones) answer after a minute.
            hang_before_headers_ms: Some(60_000),
            hang_first: 2,
            ..MockConfig::default()
        },
        |c| {
            c.shutdown_grace_ms = GRACE_MS;
            c.sse_keepalive_ms = 100;
        },
    )
    .await;
    let (http, base) = (app.http.clone(), app.base.clone());
    let hold = |body: String| {
        let (http, base) = (http.clone(), base.clone());
        tokio::spawn(async move {
            http.post(format!("{base}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
        })
    };
    let held_answer = hold(chat_body("held at shutdown"));
    wait_until(Duration::from_secs(10), "the held call's attempt", || {
        app.mock.calls() == 1
    })
    .await;
    let held_stream = hold(stream_body("held stream at shutdown"));
    wait_until(Duration::from_secs(10), "the held stream's attempt", || {
        app.mock.calls() == 2
    })
    .await;
    // The live stream, proxied and followed in the log, both mid-stream.
    let mut proxied = app.chat(&stream_body("outlive the grace")).await;
    assert_eq!(proxied.status(), 200);
    let id = header(&proxied, "holdfast-request-id");
    let mut proxied_parser = holdfast::sse::SseParser::new();
    let mut reader = get_events(&http, &base, &id, None).await;
    assert_eq!(reader.status(), 200);
    let mut reader_parser = holdfast::sse::SseParser::new();
    let mut proxied_events = next_events(&mut proxied, &mut proxied_parser, 3).await;
    let mut reader_events = next_events(&mut reader, &mut reader_parser, 3).await;

    let started = std::time::Instant::now();
    let stopping = tokio::spawn(app.stop());
    // Grace, the cut 2 s after the workers stop, and slack for a loaded machine.
    let bound = Duration::from_millis(GRACE_MS + 2_000 + 2_000);
    let ended = tokio::time::timeout(bound, async {
        tokio::join!(
            rest_of_events(&mut proxied, &mut proxied_parser),
            rest_of_events(&mut reader, &mut reader_parser),
            held_answer,
            held_stream,
        )
    })
    .await;
    let Ok((proxied_rest, reader_rest, held_answer, held_stream)) = ended else {
        panic!(
            "connections still open {:?} after shutdown began",
            started.elapsed()
        );
    };
    proxied_events.extend(proxied_rest);
    reader_events.extend(reader_rest);

    let last = proxied_events.last().expect("proxied events");
    assert_ne!(last.data, "[DONE]", "the stream was not finished");
    let error: serde_json::Value = serde_json::from_str(&last.data).expect("JSON error event");
    assert!(
        matches!(
            error["error"]["code"].as_str(),
            Some("attempt_abandoned" | "shutting_down")
        ),
        "the proxied stream ends on an error event its SDK raises on: {error}"
    );
    assert!(
        reader_events
            .iter()
            .all(|e| e.event.as_deref() != Some("end")),
        "no `end`: the request is pending, its reader resumes elsewhere"
    );
    assert!(
        reader_events
            .iter()
            .any(|e| e.event.as_deref() == Some("reset")),
        "the handed-back attempt's reset reached the reader"
    );
    for held in [held_answer, held_stream] {
        let held = held
            .expect("task")
            .expect("an answer, not a dropped connection");
        assert_eq!(held.status(), 503);
        assert_eq!(header(&held, "holdfast-error"), "shutting_down");
        assert_eq!(header(&held, "x-should-retry"), "true");
        assert!(!header(&held, "retry-after-ms").is_empty());
        assert!(!header(&held, "holdfast-request-id").is_empty());
        let body: serde_json::Value = held.json().await.expect("JSON error");
        assert_eq!(body["error"]["code"], "shutting_down", "{body}");
    }
    tokio::time::timeout(Duration::from_secs(2), stopping)
        .await
        .expect("Running::shutdown returns once its connections are closed")
        .expect("shutdown task");
}

/// Reads `response` to the end of its body (or a broken connection), returning its events.
async fn rest_of_events(
    response: &mut reqwest::Response,
    parser: &mut holdfast::sse::SseParser,
) -> Vec<holdfast::sse::SseEvent> {
    let mut events = Vec::new();
    while let Ok(Some(piece)) = response.chunk().await {
        events.extend(parser.push(&piece).expect("valid SSE"));
    }
    events
}
