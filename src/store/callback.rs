//! The callback records of the log (SPEC CB-1, CB-4, CB-6): what a request's webhook delivery
//! looks like stored, the lease a try runs under, and what a try reports.

use serde::Serialize;
use uuid::Uuid;

use super::Millis;

/// Where a request's callback delivery stands (CB-6). The database enforces the same set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CallbackState {
    /// Waiting for the request to end, due, or retrying.
    Pending,
    /// A try got a 2xx answer.
    Delivered,
    /// Given up: 410, refused at send time, or out of time (CB-4, CB-5).
    Failed,
}

impl CallbackState {
    /// The database and API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            CallbackState::Pending => "pending",
            CallbackState::Delivered => "delivered",
            CallbackState::Failed => "failed",
        }
    }

    /// Parses the database and API spelling.
    pub fn parse(s: &str) -> Option<CallbackState> {
        Some(match s {
            "pending" => CallbackState::Pending,
            "delivered" => CallbackState::Delivered,
            "failed" => CallbackState::Failed,
            _ => return None,
        })
    }
}

/// A request's callback as stored (CB-6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Callback {
    /// The request it reports.
    pub request_id: Uuid,
    /// Where it is sent.
    pub url: String,
    /// Pending, delivered or failed.
    pub state: CallbackState,
    /// Tries begun (a try is counted when it is leased).
    pub attempts: u32,
    /// When the next try may start (0: as soon as the request is terminal).
    pub next_try_at: Millis,
    /// The receiver's HTTP status of the last try, when it answered.
    pub last_status: Option<u16>,
    /// Why the last try did not deliver.
    pub last_error: Option<String>,
    /// When a try delivered it.
    pub delivered_at: Option<Millis>,
}

/// The right to make one try of a callback (CB-4), fenced on `owner` like an attempt's lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallbackLease {
    /// The request whose callback it is.
    pub request_id: Uuid,
    /// Unique per try: `<prefix>/<request id>`.
    pub owner: String,
    /// This try's number (1-based).
    pub attempt: u32,
    /// Where to send it.
    pub url: String,
    /// When the request became terminal: the give-up bound counts from here.
    pub finished_at: Millis,
    /// The request's namespace: the deliverer counts its tries in flight per namespace (CB-7).
    pub namespace: String,
}

/// What a try of a callback reports (CB-4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallbackOutcome {
    /// A 2xx answer.
    Delivered {
        /// Its status.
        status: u16,
    },
    /// Try again at `next_try_at`.
    Retry {
        /// When.
        next_try_at: Millis,
        /// The receiver's status, when it answered.
        status: Option<u16>,
        /// What went wrong.
        error: String,
    },
    /// Give up.
    Failed {
        /// The receiver's status, when it answered.
        status: Option<u16>,
        /// Why.
        error: String,
    },
}

impl CallbackOutcome {
    /// The stored state, status, error, next try and delivery time of this outcome at `now`.
    pub(crate) fn columns(
        &self,
        now: Millis,
    ) -> (
        CallbackState,
        Option<i32>,
        Option<&str>,
        Millis,
        Option<Millis>,
    ) {
        let status = |s: &Option<u16>| s.map(i32::from);
        match self {
            CallbackOutcome::Delivered { status } => (
                CallbackState::Delivered,
                Some(i32::from(*status)),
                None,
                now,
                Some(now),
            ),
            CallbackOutcome::Retry {
                next_try_at,
                status: s,
                error,
            } => (
                CallbackState::Pending,
                status(s),
                Some(error),
                *next_try_at,
                None,
            ),
            CallbackOutcome::Failed { status: s, error } => {
                (CallbackState::Failed, status(s), Some(error), now, None)
            }
        }
    }
}

/// A stored `callbacks` row's values, checked.
///
/// # Errors
/// [`super::StoreError::Corrupt`] for a state or count this version cannot read.
#[allow(clippy::too_many_arguments)]
pub(crate) fn callback_of(
    request_id: Uuid,
    url: String,
    state: &str,
    attempts: i64,
    next_try_at: i64,
    last_status: Option<i64>,
    last_error: Option<String>,
    delivered_at: Option<i64>,
) -> Result<Callback, super::StoreError> {
    let bad = |what: String| super::StoreError::corrupt(Some(request_id), what);
    Ok(Callback {
        request_id,
        url,
        state: CallbackState::parse(state)
            .ok_or_else(|| bad(format!("callback state {state:?}")))?,
        attempts: u32::try_from(attempts)
            .map_err(|_| bad(format!("callback attempts {attempts}")))?,
        next_try_at,
        last_status: last_status.and_then(|s| u16::try_from(s).ok()),
        last_error,
        delivered_at,
    })
}
