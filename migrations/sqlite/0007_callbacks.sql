-- Callbacks (SPEC CB-1..CB-6): one row per request that asked for a webhook, written in the
-- submission's transaction. It is due once its request is terminal (the request row's
-- `finished_at`, set in the transaction that makes it so, CB-4) and `next_try_at` has passed;
-- a try holds a lease like an attempt (`lease_owner`, fenced), and an expired lease is simply
-- leased again.
CREATE TABLE callbacks (
    request_id       TEXT PRIMARY KEY,               -- requests.id
    url              TEXT NOT NULL,
    state            TEXT NOT NULL DEFAULT 'pending'
                     CHECK (state = 'pending' OR state = 'delivered' OR state = 'failed'),
    attempts         INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_try_at      INTEGER NOT NULL DEFAULT 0,     -- 0: at once, once the request is terminal
    lease_owner      TEXT,
    lease_expires_at INTEGER,
    last_status      INTEGER,                        -- the receiver's HTTP status of the last try
    last_error       TEXT,                           -- why the last try did not deliver
    delivered_at     INTEGER,
    updated_at       INTEGER NOT NULL,
    CHECK (state = 'pending' OR lease_owner IS NULL),
    CHECK ((state = 'delivered') = (delivered_at IS NOT NULL))
);
CREATE INDEX callbacks_due ON callbacks (next_try_at) WHERE state = 'pending';
CREATE INDEX callbacks_state ON callbacks (state, request_id);
