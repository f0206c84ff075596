//! Recent answers: the succeeded requests this process answered, by claim, so that a duplicate
//! submission while the claim lives (ID-4, ID-5) is answered without a database write.
//!
//! A succeeded request never changes again and its claim is never released before it expires
//! (ID-6 releases claims only on failures), so what the store would answer a duplicate until
//! the claim's expiry is known in advance: `Attached` with this record. Only the delivery count
//! still goes to the store, after the answer, as for any duplicate. An entry is used only
//! while its claim lives and only for a submission with the same fingerprint (a different body
//! under the same `Idempotency-Key` goes to the store, which answers 422). Bounded by the bytes
//! of the records it holds; the oldest go first.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use crate::store::{Millis, RequestRecord, Status};

/// Bytes of records kept at most.
const MAX_BYTES: usize = 64 * 1024 * 1024;
/// A record larger than this is not kept (it would push out many small ones).
const MAX_RECORD_BYTES: usize = 1024 * 1024;

/// A claim as admission computes it: which namespace and key, the fingerprint of the body
/// that holds it, and until when it lives.
#[derive(Debug, Clone)]
pub(crate) struct ClaimRef<'a> {
    pub(crate) namespace: &'a str,
    pub(crate) claim_key: &'a str,
    pub(crate) fingerprint: [u8; 32],
    pub(crate) expires_at: Millis,
}

struct Entry {
    /// The settled record the answer was made from, shared, not copied (issue 30).
    record: Arc<RequestRecord>,
    /// Replays answered from this entry: the record's `replayed` count plus these is the
    /// store's.
    replays: u32,
    fingerprint: [u8; 32],
    expires_at: Millis,
    bytes: usize,
    /// Insertion number, to tell this entry from a later one under the same key.
    serial: u64,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<(String, String), Entry>,
    /// Keys in insertion order, with the serial they were inserted with.
    order: VecDeque<((String, String), u64)>,
    bytes: usize,
    serial: u64,
}

/// See the module documentation.
#[derive(Default)]
pub(crate) struct RecentAnswers {
    inner: Mutex<Inner>,
}

impl RecentAnswers {
    /// The succeeded request `claim` points at, counted as one more replay, when it is known
    /// and the claim lives at `now` for this fingerprint.
    pub(crate) fn replay(
        &self,
        namespace: &str,
        claim_key: &str,
        fingerprint: &[u8; 32],
        now: Millis,
    ) -> Option<RequestRecord> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let key = (namespace.to_owned(), claim_key.to_owned());
        let entry = inner.entries.get_mut(&key)?;
        if entry.expires_at <= now {
            let gone = inner.entries.remove(&key).map_or(0, |e| e.bytes);
            inner.bytes -= gone;
            return None;
        }
        if &entry.fingerprint != fingerprint {
            return None;
        }
        // The caller counts this delivery on its copy; the entry counts it too, so the next
        // replay sees every earlier one.
        let mut record = (*entry.record).clone();
        record.replayed += entry.replays;
        entry.replays += 1;
        Some(record)
    }

    /// Keeps `record` for duplicates of `claim` when it succeeded.
    pub(crate) fn remember(&self, claim: &ClaimRef<'_>, record: &Arc<RequestRecord>) {
        if record.status != Status::Succeeded {
            return;
        }
        let bytes = record.body.len()
            + record.response_body.as_ref().map_or(0, Vec::len)
            + record
                .headers
                .iter()
                .map(|(n, v)| n.len() + v.len())
                .sum::<usize>()
            + claim.claim_key.len()
            + 512;
        if bytes > MAX_RECORD_BYTES {
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.serial += 1;
        let serial = inner.serial;
        let key = (claim.namespace.to_owned(), claim.claim_key.to_owned());
        let entry = Entry {
            record: Arc::clone(record),
            replays: 0,
            fingerprint: claim.fingerprint,
            expires_at: claim.expires_at,
            bytes,
            serial,
        };
        if let Some(old) = inner.entries.insert(key.clone(), entry) {
            inner.bytes -= old.bytes;
        }
        inner.bytes += bytes;
        inner.order.push_back((key, serial));
        while inner.bytes > MAX_BYTES || inner.order.len() > 4 * inner.entries.len() + 64 {
            let Some((key, serial)) = inner.order.pop_front() else {
                break;
            };
            if inner.entries.get(&key).is_some_and(|e| e.serial == serial) {
                let gone = inner.entries.remove(&key).map_or(0, |e| e.bytes);
                inner.bytes -= gone;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(status: Status) -> Arc<RequestRecord> {
        Arc::new(RequestRecord::example(status))
    }

    fn claim(key: &str, fingerprint: u8, expires_at: Millis) -> ClaimRef<'_> {
        ClaimRef {
            namespace: "default",
            claim_key: key,
            fingerprint: [fingerprint; 32],
            expires_at,
        }
    }

    #[test]
    fn a_succeeded_answer_replays_while_its_claim_lives_for_the_same_fingerprint_only_id4_id5() {
        let answers = RecentAnswers::default();
        let r = record(Status::Succeeded);
        answers.remember(&claim("k", 1, 100), &r);
        let replayed = answers.replay("default", "k", &[1; 32], 99).unwrap();
        assert_eq!(replayed.id, r.id);
        assert_eq!(replayed.replayed, 0, "the caller counts its own delivery");
        assert_eq!(
            answers
                .replay("default", "k", &[1; 32], 99)
                .unwrap()
                .replayed,
            1
        );
        assert!(answers.replay("default", "k", &[2; 32], 99).is_none());
        assert!(answers.replay("other", "k", &[1; 32], 99).is_none());
        assert!(answers.replay("default", "k", &[1; 32], 100).is_none());
        assert!(
            answers.replay("default", "k", &[1; 32], 50).is_none(),
            "expired is gone"
        );
    }

    #[test]
    fn only_succeeded_requests_are_kept_id6() {
        let answers = RecentAnswers::default();
        for status in [Status::Pending, Status::Running, Status::Failed] {
            answers.remember(&claim("k", 1, 100), &record(status));
            assert!(answers.replay("default", "k", &[1; 32], 0).is_none());
        }
    }

    #[test]
    fn the_oldest_answers_go_first_beyond_the_byte_bound() {
        let answers = RecentAnswers::default();
        let mut big = RequestRecord::example(Status::Succeeded);
        big.response_body = Some(vec![b'x'; MAX_RECORD_BYTES - 4096]);
        let big = Arc::new(big);
        let n = MAX_BYTES / (MAX_RECORD_BYTES - 2048) + 2;
        for i in 0..n {
            answers.remember(&claim(&i.to_string(), 1, 100), &big);
        }
        assert!(answers.replay("default", "0", &[1; 32], 0).is_none());
        assert!(
            answers
                .replay("default", &(n - 1).to_string(), &[1; 32], 0)
                .is_some()
        );
        let inner = answers.inner.lock().unwrap_or_else(|e| e.into_inner());
        assert!(inner.bytes <= MAX_BYTES, "{}", inner.bytes);
    }
}
