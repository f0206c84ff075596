-- The durable request log (SPEC LC-1, ID-4..ID-7). Timestamps are Unix milliseconds.
CREATE TABLE requests (
    id                  TEXT PRIMARY KEY,            -- UUID v7
    namespace           TEXT NOT NULL,
    route               TEXT NOT NULL,               -- openai.chat, anthropic.messages, ...
    backend             TEXT NOT NULL,
    model               TEXT,                        -- model sent upstream, after rewriting
    stream              INTEGER NOT NULL CHECK (stream IN (0, 1)),
    body                BLOB NOT NULL,               -- bytes sent upstream (ID-3b)
    headers             TEXT NOT NULL,               -- JSON array of [name, value] (ID-3a)
    hash                BLOB NOT NULL,               -- request hash (ID-3)
    claim_kind          TEXT NOT NULL CHECK (claim_kind IN ('hash', 'key')),
    status              TEXT NOT NULL CHECK (status IN ('pending', 'running', 'succeeded', 'failed')),
    attempts            INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    recoveries          INTEGER NOT NULL DEFAULT 0 CHECK (recoveries >= 0),
    next_retry_at       INTEGER NOT NULL,
    lease_owner         TEXT,                        -- unique per attempt; every worker write is fenced on it (LC-3)
    lease_expires_at    INTEGER,
    error_type          TEXT CHECK (error_type IN ('upstream_refused', 'attempts_exhausted', 'stream_interrupted',
                                                   'lease_expired', 'cancelled', 'upstream_invalid')),
    error_message       TEXT,
    error_status        INTEGER,
    response_status     INTEGER,
    response_body       BLOB,
    upstream_request_id TEXT,
    last_seq            INTEGER NOT NULL DEFAULT 0,
    created_at          INTEGER NOT NULL,
    updated_at          INTEGER NOT NULL,
    finished_at         INTEGER,
    -- A running request has a lease; nothing else does.
    CHECK ((status = 'running') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)),
    -- Terminal requests, and only they, have finished_at.
    CHECK ((status IN ('succeeded', 'failed')) = (finished_at IS NOT NULL)),
    -- A failed request says why.
    CHECK (status <> 'failed' OR error_type IS NOT NULL)
);

CREATE INDEX requests_due ON requests (next_retry_at) WHERE status = 'pending';
CREATE INDEX requests_leases ON requests (lease_expires_at) WHERE status = 'running';
CREATE INDEX requests_namespace_id ON requests (namespace, id);
CREATE INDEX requests_finished ON requests (finished_at) WHERE finished_at IS NOT NULL;

-- (namespace, claim_key) -> request. The primary key is what makes a claim atomic (ID-7).
CREATE TABLE claims (
    namespace   TEXT NOT NULL,
    claim_key   TEXT NOT NULL,                       -- hex body hash, or "<route> <Idempotency-Key>"
    kind        TEXT NOT NULL CHECK (kind IN ('hash', 'key')),
    request_id  TEXT NOT NULL,
    fingerprint BLOB NOT NULL,                       -- request hash of the claimed body
    expires_at  INTEGER NOT NULL,
    PRIMARY KEY (namespace, claim_key)
);

CREATE INDEX claims_request ON claims (request_id);
