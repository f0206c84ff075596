//! Which provider outcomes are retried, and when (SPEC LC-5, LC-6); and how long a write that
//! holds a paid answer is tried again ([`WriteRetry`], decision 37).

use std::time::Duration;

use tokio::time::Instant;

use reqwest::header::HeaderMap;

use crate::config::Workers;
use crate::store::StoreError;

/// Whether an upstream HTTP status is transient (LC-5): 408, 409, 425, 429 and every 5xx.
/// Every other 4xx is a terminal refusal (LC-6).
pub(super) fn is_transient_status(status: u16) -> bool {
    matches!(status, 408 | 409 | 425 | 429) || (500..=599).contains(&status)
}

/// The provider's requested delay: `retry-after-ms` (milliseconds, OpenAI), else `retry-after`
/// as delta-seconds or an HTTP date (RFC 9110 §10.2.3). `None` when absent or unreadable.
pub(super) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    if let Some(ms) = headers
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|ms| ms.is_finite() && *ms >= 0.0)
    {
        return Some(Duration::from_millis(ms as u64));
    }
    let value = headers.get("retry-after")?.to_str().ok()?.trim();
    if let Ok(secs) = value.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0)
            .then(|| Duration::from_millis((secs * 1000.0) as u64));
    }
    let at = chrono::DateTime::parse_from_rfc2822(value).ok()?;
    let delta = at.signed_duration_since(chrono::Utc::now());
    Some(delta.to_std().unwrap_or(Duration::ZERO))
}

/// Delay before attempt `attempt + 1` after transient failure number `attempt` (1-based):
/// exponential from `backoff_initial_ms`, capped at `backoff_max_ms`, with "equal jitter" (half
/// fixed, half random) so that a burst of failures does not retry in lock-step. A provider's
/// `retry-after` is honoured as a lower bound, itself capped at `backoff_max_ms` (LC-5).
pub(super) fn backoff(
    workers: &Workers,
    attempt: u32,
    provider_hint: Option<Duration>,
) -> Duration {
    let max = workers.backoff_max_ms;
    let exp = workers
        .backoff_initial_ms
        .saturating_mul(1u64 << attempt.saturating_sub(1).min(32))
        .min(max);
    let half = exp / 2;
    let jittered = half + rand::random_range(0..=exp - half);
    let hinted = provider_hint.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    Duration::from_millis(jittered.max(hinted).min(max))
}

/// Whether a failed store write may succeed when tried again: the database could not do it
/// now (a lost connection, a full disk). A corrupt row stays corrupt.
pub(super) fn is_transient(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable(_))
}

/// First wait between two tries of a failed write of an attempt.
const WRITE_RETRY_FIRST: Duration = Duration::from_millis(50);
/// Longest wait between two tries of a failed write of an attempt.
const WRITE_RETRY_MAX: Duration = Duration::from_secs(1);

/// How a failed write of an attempt — its chunks or its outcome — is tried again (decision
/// 37, decision 52). Once the provider has answered, giving up costs a second provider call
/// when the sweep re-runs the request, so the write is tried for `workers.write_retry_secs`
/// (at least one lease length) from the first failure — the heartbeat renews the lease as soon
/// as the database is back, and sweeps hold meanwhile — waiting 50 ms, doubling to 1 s, between
/// tries. The writes are fenced (LC-3), so a try that comes after the lease was lost stores
/// nothing, and one whose earlier try had committed stores nothing twice.
#[derive(Debug)]
pub(super) struct WriteRetry {
    /// No try starts after this.
    deadline: Instant,
    /// The next wait.
    delay: Duration,
}

impl WriteRetry {
    /// A retry window of `window`, from now (the first failure).
    pub(super) fn new(window: Duration) -> WriteRetry {
        WriteRetry::starting(Instant::now(), window)
    }

    /// A retry window of `window` from `now`.
    fn starting(now: Instant, window: Duration) -> WriteRetry {
        WriteRetry {
            deadline: now + window,
            delay: WRITE_RETRY_FIRST,
        }
    }

    /// Whether the window is over: no more tries.
    pub(super) fn is_spent(&self) -> bool {
        Instant::now() >= self.deadline
    }

    /// Waits before the next try; `false` (at once) when the window is spent.
    pub(super) async fn wait(&mut self) -> bool {
        match self.next_wait(Instant::now()) {
            Some(wait) => {
                tokio::time::sleep(wait).await;
                true
            }
            None => false,
        }
    }

    /// The wait before the next try when it is `now`; `None` when the window is spent.
    fn next_wait(&mut self, now: Instant) -> Option<Duration> {
        let left = self.deadline.checked_duration_since(now)?;
        if left.is_zero() {
            return None;
        }
        let wait = self.delay.min(left);
        self.delay = (self.delay * 2).min(WRITE_RETRY_MAX);
        Some(wait)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    #[test]
    fn transient_statuses_follow_lc5_and_other_4xx_are_terminal_lc6() {
        for s in [408, 409, 425, 429, 500, 502, 503, 504, 529] {
            assert!(is_transient_status(s), "{s}");
        }
        for s in [400, 401, 403, 404, 413, 422] {
            assert!(!is_transient_status(s), "{s}");
        }
    }

    #[test]
    fn backoff_grows_exponentially_within_jitter_and_is_capped() {
        let w = Workers {
            backoff_initial_ms: 100,
            backoff_max_ms: 1_000,
            ..Workers::default()
        };
        for _ in 0..200 {
            let d1 = backoff(&w, 1, None).as_millis();
            assert!((50..=100).contains(&d1), "{d1}");
            let d3 = backoff(&w, 3, None).as_millis();
            assert!((200..=400).contains(&d3), "{d3}");
            let d9 = backoff(&w, 9, None).as_millis();
            assert!((500..=1_000).contains(&d9), "{d9}");
        }
    }

    #[test]
    fn retry_after_is_a_lower_bound_capped_at_backoff_max_lc5() {
        let w = Workers {
            backoff_initial_ms: 100,
            backoff_max_ms: 5_000,
            ..Workers::default()
        };
        let d = backoff(&w, 1, Some(Duration::from_secs(2)));
        assert_eq!(d, Duration::from_secs(2));
        let d = backoff(&w, 1, Some(Duration::from_secs(600)));
        assert_eq!(d, Duration::from_secs(5));
    }

    #[test]
    fn a_failed_write_is_tried_with_doubling_waits_until_one_window_is_spent() {
        let mut now = Instant::now();
        let mut retry = WriteRetry::starting(now, Duration::from_secs(3));
        let mut waits = Vec::new();
        while let Some(wait) = retry.next_wait(now) {
            waits.push(wait.as_millis());
            now += wait;
        }
        assert_eq!(waits, [50, 100, 200, 400, 800, 1000, 450]);
        assert_eq!(retry.next_wait(now), None, "a spent window stays spent");
    }

    #[test]
    fn retry_after_headers_parse_ms_seconds_and_dates() {
        let mut h = HeaderMap::new();
        h.insert("retry-after", HeaderValue::from_static("3"));
        assert_eq!(retry_after(&h), Some(Duration::from_secs(3)));
        h.insert("retry-after-ms", HeaderValue::from_static("250.5"));
        assert_eq!(retry_after(&h), Some(Duration::from_millis(250)));
        let mut h = HeaderMap::new();
        h.insert(
            "retry-after",
            HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"),
        );
        assert_eq!(retry_after(&h), Some(Duration::ZERO));
        h.insert("retry-after", HeaderValue::from_static("soon"));
        assert_eq!(retry_after(&h), None);
    }
}
