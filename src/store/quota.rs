//! What one lease may take when a node's slots are shared between namespaces (SPEC LC-2a for
//! requests, CB-7 for webhook deliveries).

/// What one lease may take: first, per namespace, up to its share of its own oldest due work;
/// then, of the slots the shares left, all but `keep_free` go to the oldest due work of any
/// namespace. Each step reads about as many rows as it leases, whatever the backlog (the
/// `requests_namespace_due` and `requests_due` indexes for requests, `callbacks_namespace_due`
/// and `callbacks_due` for deliveries).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LeaseQuota {
    /// Namespace and how many of its due rows the first step may take (0: none).
    pub shares: Vec<(String, usize)>,
    /// Most rows in all: the leaser's free slots.
    pub limit: usize,
    /// Slots of `limit` the second step leaves free when the shares did not fill them: the
    /// next namespace's share, so work that cannot be taken back never holds it.
    pub keep_free: usize,
    /// Most rows the second step may take at all: the free slots no namespace's unused share
    /// holds (LC-2a). `usize::MAX`: no bound but `limit` and `keep_free`.
    pub lend_cap: usize,
}

impl LeaseQuota {
    /// Up to `limit` of the oldest due rows, whatever their namespace (one pool).
    pub fn any(limit: usize) -> LeaseQuota {
        LeaseQuota {
            shares: Vec::new(),
            limit,
            keep_free: 0,
            lend_cap: usize::MAX,
        }
    }

    /// Rows the second step may lend after the first took `taken`.
    pub fn lendable(&self, taken: usize) -> usize {
        self.limit
            .saturating_sub(taken)
            .saturating_sub(self.keep_free)
            .min(self.lend_cap)
    }

    /// Each share as the first step runs it: at most `limit`, the empty ones left out, and a
    /// namespace named twice taken once (its first share), so no row is chosen twice.
    pub fn nonzero_shares(&self) -> impl Iterator<Item = (&str, usize)> {
        self.shares
            .iter()
            .enumerate()
            .filter(|(i, (namespace, _))| {
                !self.shares[..*i]
                    .iter()
                    .any(|(before, _)| before == namespace)
            })
            .map(|(_, (namespace, n))| (namespace.as_str(), (*n).min(self.limit)))
            .filter(|(_, n)| *n > 0)
    }
}
