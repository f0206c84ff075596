-- The durable request log (SPEC LC-1, ID-4..ID-7), PostgreSQL flavour of
-- migrations/sqlite/0001_requests.sql: same columns, same CHECK constraints. Timestamps are Unix
-- milliseconds (BIGINT), as in SQLite, so both adapters share one record shape.
CREATE TABLE requests (
    id                  UUID PRIMARY KEY,            -- UUID v7
    namespace           TEXT NOT NULL,
    route               TEXT NOT NULL,               -- openai.chat, anthropic.messages, ...
    backend             TEXT NOT NULL,
    model               TEXT,                        -- model sent upstream, after rewriting
    stream              BOOLEAN NOT NULL,
    body                BYTEA NOT NULL,              -- bytes sent upstream (ID-3b)
    headers             TEXT NOT NULL,               -- JSON array of [name, value] (ID-3a)
    hash                BYTEA NOT NULL,              -- request hash (ID-3)
    claim_kind          TEXT NOT NULL CHECK (claim_kind IN ('hash', 'key')),
    status              TEXT NOT NULL CHECK (status IN ('pending', 'running', 'succeeded', 'failed')),
    attempts            INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    recoveries          INTEGER NOT NULL DEFAULT 0 CHECK (recoveries >= 0),
    next_retry_at       BIGINT NOT NULL,
    lease_owner         TEXT,                        -- unique per attempt; every worker write is fenced on it (LC-3)
    lease_expires_at    BIGINT,
    error_type          TEXT CHECK (error_type IN ('upstream_refused', 'attempts_exhausted', 'stream_interrupted',
                                                   'lease_expired', 'cancelled', 'upstream_invalid')),
    error_message       TEXT,
    error_status        INTEGER,
    response_status     INTEGER,
    response_body       BYTEA,
    upstream_request_id TEXT,
    last_seq            BIGINT NOT NULL DEFAULT 0,
    created_at          BIGINT NOT NULL,
    updated_at          BIGINT NOT NULL,
    finished_at         BIGINT,
    -- A running request has a lease; nothing else does.
    CHECK ((status = 'running') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)),
    -- Terminal requests, and only they, have finished_at.
    CHECK ((status IN ('succeeded', 'failed')) = (finished_at IS NOT NULL)),
    -- A failed request says why.
    CHECK (status <> 'failed' OR error_type IS NOT NULL)
);

-- Leasing walks this index in (next_retry_at, id) order with FOR UPDATE SKIP LOCKED (LC-2, DU-3).
CREATE INDEX requests_due ON requests (next_retry_at, id) WHERE status = 'pending';
CREATE INDEX requests_leases ON requests (lease_expires_at) WHERE status = 'running';
CREATE INDEX requests_namespace_id ON requests (namespace, id);
CREATE INDEX requests_finished ON requests (finished_at) WHERE finished_at IS NOT NULL;

-- (namespace, claim_key) -> request. The primary key is what makes a claim atomic (ID-7).
CREATE TABLE claims (
    namespace   TEXT NOT NULL,
    claim_key   TEXT NOT NULL,                       -- hex body hash, or "<route> <Idempotency-Key>"
    kind        TEXT NOT NULL CHECK (kind IN ('hash', 'key')),
    request_id  UUID NOT NULL,
    fingerprint BYTEA NOT NULL,                      -- request hash of the claimed body
    expires_at  BIGINT NOT NULL,
    PRIMARY KEY (namespace, claim_key)
);

CREATE INDEX claims_request ON claims (request_id);
