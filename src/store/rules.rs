//! Lifecycle decisions both adapters make the same way (SPEC LC-4, LC-6, LC-8, LC-9, ID-6,
//! RD-5, RD-6). Each adapter runs only the SQL; what to write is decided here, once.

use super::{
    Chunk, ChunkKind, ClaimKind, ErrorInfo, ErrorType, Millis, Outcome, RequestRecord, Status,
};

/// `error.message` of a request whose last lease expired with no attempts left (LC-4).
pub(crate) const LEASE_EXPIRED_MESSAGE: &str =
    "the worker running the last attempt stopped renewing its lease and no attempts are left";

/// `error.message` of a cancelled request (LC-9).
pub(crate) const CANCELLED_MESSAGE: &str = "cancelled through POST /requests/{id}/cancel";

/// Whether a terminal failure of `kind` releases a claim of `claim` (ID-6): a body-hash claim is
/// released by every failure; an explicit key keeps its claim after a deterministic refusal
/// (and replays it) and releases on everything else.
pub fn failure_releases_claim(claim: ClaimKind, kind: ErrorType) -> bool {
    match claim {
        ClaimKind::BodyHash => true,
        ClaimKind::Key => kind != ErrorType::UpstreamRefused,
    }
}

/// How long a claim that a failure releases still holds after the failure (ID-6a, decision 140):
/// an identical send meanwhile (a client retrying the 502 or 503) gets the failure.
pub const FAILURE_WINDOW_MS: Millis = 60_000;

/// The expiry that a failure recorded at `now` gives the claims it releases (ID-6a): a minute
/// on, or the claim's own expiry where that comes sooner (the stores take the earlier).
pub fn released_claim_expiry(now: Millis) -> Millis {
    now.saturating_add(FAILURE_WINDOW_MS)
}

/// What the write that makes a request terminal also does, in its transaction: append the
/// `end` chunk with this data (RD-5), and release the request's claims when `release_claim`
/// (ID-6, after the window of ID-6a).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Settle {
    /// The `end` chunk's data: `{"status","error"}`.
    pub end: String,
    /// Release the claims that point at the request (ID-6, ID-6a).
    pub release_claim: bool,
}

/// How a request of claim kind `claim` settles as `status` with `error`.
pub(crate) fn settle(status: Status, error: Option<&ErrorInfo>, claim: ClaimKind) -> Settle {
    Settle {
        end: end_data(status, error),
        release_claim: releases_claim(status, error, claim),
    }
}

/// Whether a request of claim kind `claim` that settles as `status` with `error` releases its
/// claims ([`Settle::release_claim`], ID-6).
pub(crate) fn releases_claim(status: Status, error: Option<&ErrorInfo>, claim: ClaimKind) -> bool {
    status == Status::Failed && error.is_some_and(|e| failure_releases_claim(claim, e.kind))
}

/// The `data` of an `end` chunk: `{"status","error"}` (RD-5).
pub fn end_data(status: Status, error: Option<&ErrorInfo>) -> String {
    serde_json::json!({ "status": status, "error": error }).to_string()
}

/// The `end` chunk that the write which made `settled` terminal stored with it, as PostgreSQL
/// stores it and SQLite reads it from the row (decision 134): at the record's last seq, as its
/// last attempt's, with [`end_data`] of the record as it reads back (RD-5). `None` while the
/// record is not terminal.
pub fn end_chunk(settled: &RequestRecord) -> Option<Chunk> {
    end_chunk_of(
        settled.status,
        settled.error.as_ref(),
        settled.attempts,
        settled.last_seq,
    )
}

/// [`end_chunk`] of a request's status, error, attempts and last seq as its row holds them.
pub(crate) fn end_chunk_of(
    status: Status,
    error: Option<&ErrorInfo>,
    attempts: u32,
    last_seq: i64,
) -> Option<Chunk> {
    status.is_terminal().then(|| Chunk {
        seq: last_seq,
        attempt: attempts,
        kind: ChunkKind::End,
        event: None,
        data: end_data(status, error).into(),
    })
}

/// The `reset` chunk that separates an abandoned attempt from the next one (LC-8, RD-6):
/// needed only when the abandoned attempt (number `attempts`) stored chunks after the latest
/// reset. Its data is the next attempt's number; the chunk is written as that attempt's.
pub(crate) fn reset_after(attempts: u32, last_seq: i64, reset_seq: i64) -> Option<(u32, String)> {
    (last_seq > reset_seq).then(|| {
        let next = attempts.saturating_add(1);
        (next, next.to_string())
    })
}

/// What the sweep does with a `running` request whose lease expired (LC-4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Expired {
    /// Back to `pending` with `recoveries + 1`, after a `reset` chunk when one is due.
    Recover {
        /// The reset chunk's attempt number and data ([`reset_after`]).
        reset: Option<(u32, String)>,
    },
    /// No attempts left: `failed` with this error.
    Fail(ErrorInfo),
}

/// The sweep's verdict on an expired lease of a request with `attempts` of `max_attempts`.
pub(crate) fn expired(attempts: u32, max_attempts: u32, last_seq: i64, reset_seq: i64) -> Expired {
    if attempts >= max_attempts {
        Expired::Fail(ErrorInfo {
            kind: ErrorType::LeaseExpired,
            message: LEASE_EXPIRED_MESSAGE.into(),
            status: None,
        })
    } else {
        Expired::Recover {
            reset: reset_after(attempts, last_seq, reset_seq),
        }
    }
}

/// `error.message` of a request handed back at shutdown on its last attempt (DU-5).
pub(crate) const HANDED_BACK_MESSAGE: &str =
    "its last attempt was handed back at shutdown and no attempts are left";

/// What a hand-back at shutdown does (DU-5): the sweep's verdict at once ([`expired`]), with no
/// recovery counted — back to `pending` (a `reset` if the attempt stored chunks) while attempts
/// are left, else `failed` with `lease_expired`, as a crash at that moment would end it, so
/// `attempts` never exceeds `max_attempts`.
pub(crate) fn handed_back(
    attempts: u32,
    max_attempts: u32,
    last_seq: i64,
    reset_seq: i64,
) -> Expired {
    match expired(attempts, max_attempts, last_seq, reset_seq) {
        Expired::Fail(error) => Expired::Fail(ErrorInfo {
            message: HANDED_BACK_MESSAGE.into(),
            ..error
        }),
        recover => recover,
    }
}

/// The error of a cancelled request (LC-9).
pub(crate) fn cancelled() -> ErrorInfo {
    ErrorInfo {
        kind: ErrorType::Cancelled,
        message: CANCELLED_MESSAGE.into(),
        status: None,
    }
}

/// Whether `record` holds the outcome attempt `attempt` wrote (LC-3, decision 38). An outcome
/// write tried again after a failure finds the request no longer under its lease when an
/// earlier try committed and only the answer was lost — or when the lease was lost. Only the
/// attempt itself can leave the request at its own attempt number with its own outcome: a
/// recovery and a later lease raise `attempts`, and the sweep and a cancel fail a request with
/// `lease_expired` or `cancelled`, which no attempt writes.
pub(crate) fn holds_outcome(record: &RequestRecord, attempt: u32, outcome: &Outcome) -> bool {
    // The stored message may differ in bytes a database cannot hold; kind and status decide.
    let same_error = |error: &ErrorInfo| {
        record
            .error
            .as_ref()
            .is_some_and(|e| e.kind == error.kind && e.status == error.status)
    };
    record.attempts == attempt
        && match outcome {
            Outcome::Succeeded { .. } => record.status == Status::Succeeded,
            Outcome::Failed { error, .. } => record.status == Status::Failed && same_error(error),
            Outcome::Retry {
                next_retry_at,
                error,
            } => {
                record.status == Status::Pending
                    && record.next_retry_at == *next_retry_at
                    && same_error(error)
            }
        }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(kind: ErrorType, status: Option<u16>) -> ErrorInfo {
        ErrorInfo {
            kind,
            message: "m".into(),
            status,
        }
    }

    #[test]
    fn an_attempt_recognises_only_its_own_outcome_decision38() {
        let succeeded = Outcome::Succeeded {
            status: 200,
            body: b"{}".to_vec(),
            upstream_request_id: None,
            response_id: None,
            usage: None,
        };
        let mut record = RequestRecord::example(Status::Succeeded);
        record.attempts = 2;
        assert!(holds_outcome(&record, 2, &succeeded));
        // A recovery and a later lease: another attempt's number.
        assert!(!holds_outcome(&record, 1, &succeeded));
        // Failed by the sweep or a cancel, or still running under another lease.
        for status in [Status::Failed, Status::Running, Status::Pending] {
            record.status = status;
            assert!(!holds_outcome(&record, 2, &succeeded), "{status:?}");
        }

        let refused = Outcome::Failed {
            error: error(ErrorType::UpstreamRefused, Some(400)),
            response: None,
            upstream_request_id: None,
            usage: None,
        };
        record.status = Status::Failed;
        record.error = Some(error(ErrorType::UpstreamRefused, Some(400)));
        assert!(holds_outcome(&record, 2, &refused));
        record.error = Some(error(ErrorType::LeaseExpired, None));
        assert!(!holds_outcome(&record, 2, &refused));

        let retry = Outcome::Retry {
            next_retry_at: 5_000,
            error: error(ErrorType::UpstreamRefused, Some(503)),
        };
        record.status = Status::Pending;
        record.next_retry_at = 5_000;
        record.error = Some(error(ErrorType::UpstreamRefused, Some(503)));
        assert!(holds_outcome(&record, 2, &retry));
        // Sent back by the sweep: due at another moment.
        record.next_retry_at = 4_321;
        assert!(!holds_outcome(&record, 2, &retry));
    }

    #[test]
    fn only_a_keyed_refusal_keeps_its_claim_id6() {
        for kind in [
            ErrorType::UpstreamRefused,
            ErrorType::AttemptsExhausted,
            ErrorType::StreamInterrupted,
            ErrorType::LeaseExpired,
            ErrorType::Cancelled,
            ErrorType::UpstreamInvalid,
        ] {
            assert!(failure_releases_claim(ClaimKind::BodyHash, kind));
            assert_eq!(
                failure_releases_claim(ClaimKind::Key, kind),
                kind != ErrorType::UpstreamRefused
            );
        }
        let ok = settle(Status::Succeeded, None, ClaimKind::BodyHash);
        assert!(!ok.release_claim);
        assert_eq!(ok.end, r#"{"error":null,"status":"succeeded"}"#);
    }

    #[test]
    fn the_sweep_recovers_while_attempts_are_left_and_resets_only_after_chunks_lc4_lc8() {
        assert_eq!(expired(1, 5, 0, 0), Expired::Recover { reset: None });
        assert_eq!(
            expired(2, 5, 7, 3),
            Expired::Recover {
                reset: Some((3, "3".into()))
            }
        );
        assert!(
            matches!(expired(5, 5, 7, 3), Expired::Fail(e) if e.kind == ErrorType::LeaseExpired)
        );
    }
}
