-- `requests` and `chunks` rebuilt for the writer's sake (decision 35); the rules are unchanged.
--
-- 1. A request's body and headers move to `request_bodies`, written once at submission. A
--    request row is updated many times — leased, every stream batch's seq reservation,
--    finished, counted — and SQLite rewrites the whole row each time: with the prompt inside
--    it, a 50 KB prompt made storing a stream's chunks about four times slower.
-- 2. CHECK lists of three or more values are written as `=` comparisons joined by OR. SQLite
--    evaluates `x IN (a, b, c)` in a CHECK by building a temporary index of the list for every
--    row it writes (lists of one or two values are compared inline). A NULL `error_type` still
--    passes.
CREATE TABLE request_bodies (
    id      TEXT PRIMARY KEY,                        -- requests.id
    body    BLOB NOT NULL,                           -- bytes sent upstream (ID-3b)
    headers TEXT NOT NULL                            -- JSON array of [name, value] (ID-3a)
);
INSERT INTO request_bodies (id, body, headers) SELECT id, body, headers FROM requests ORDER BY rowid;

CREATE TABLE requests_new (
    id                  TEXT PRIMARY KEY,            -- UUID v7
    namespace           TEXT NOT NULL,
    route               TEXT NOT NULL,               -- openai.chat, anthropic.messages, ...
    backend             TEXT NOT NULL,
    model               TEXT,                        -- model sent upstream, after rewriting
    stream              INTEGER NOT NULL CHECK (stream IN (0, 1)),
    hash                BLOB NOT NULL,               -- request hash (ID-3)
    claim_kind          TEXT NOT NULL CHECK (claim_kind IN ('hash', 'key')),
    status              TEXT NOT NULL CHECK (status = 'pending' OR status = 'running'
                                             OR status = 'succeeded' OR status = 'failed'),
    attempts            INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    recoveries          INTEGER NOT NULL DEFAULT 0 CHECK (recoveries >= 0),
    next_retry_at       INTEGER NOT NULL,
    lease_owner         TEXT,                        -- unique per attempt; every worker write is fenced on it (LC-3)
    lease_expires_at    INTEGER,
    error_type          TEXT CHECK (error_type = 'upstream_refused' OR error_type = 'attempts_exhausted'
                                    OR error_type = 'stream_interrupted' OR error_type = 'lease_expired'
                                    OR error_type = 'cancelled' OR error_type = 'upstream_invalid'),
    error_message       TEXT,
    error_status        INTEGER,
    response_status     INTEGER,
    response_body       BLOB,
    upstream_request_id TEXT,
    last_seq            INTEGER NOT NULL DEFAULT 0,
    created_at          INTEGER NOT NULL,
    updated_at          INTEGER NOT NULL,
    finished_at         INTEGER,
    reset_seq           INTEGER NOT NULL DEFAULT 0,  -- seq of the latest `reset` chunk (0: none)
    attached            INTEGER NOT NULL DEFAULT 0,
    replayed            INTEGER NOT NULL DEFAULT 0,
    log_reads           INTEGER NOT NULL DEFAULT 0,
    usage_input_tokens        INTEGER,
    usage_output_tokens       INTEGER,
    usage_cached_input_tokens INTEGER,
    usage_cache_write_tokens  INTEGER,
    usage_reasoning_tokens    INTEGER,
    -- A running request has a lease; nothing else does.
    CHECK ((status = 'running') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)),
    -- Terminal requests, and only they, have finished_at.
    CHECK ((status IN ('succeeded', 'failed')) = (finished_at IS NOT NULL)),
    -- A failed request says why.
    CHECK (status <> 'failed' OR error_type IS NOT NULL)
);
INSERT INTO requests_new (id, namespace, route, backend, model, stream, hash,
        claim_kind, status, attempts, recoveries, next_retry_at, lease_owner, lease_expires_at,
        error_type, error_message, error_status, response_status, response_body,
        upstream_request_id, last_seq, created_at, updated_at, finished_at, reset_seq, attached,
        replayed, log_reads, usage_input_tokens, usage_output_tokens, usage_cached_input_tokens,
        usage_cache_write_tokens, usage_reasoning_tokens)
    SELECT id, namespace, route, backend, model, stream, hash,
        claim_kind, status, attempts, recoveries, next_retry_at, lease_owner, lease_expires_at,
        error_type, error_message, error_status, response_status, response_body,
        upstream_request_id, last_seq, created_at, updated_at, finished_at, reset_seq, attached,
        replayed, log_reads, usage_input_tokens, usage_output_tokens, usage_cached_input_tokens,
        usage_cache_write_tokens, usage_reasoning_tokens
    FROM requests ORDER BY rowid;
DROP TABLE requests;
ALTER TABLE requests_new RENAME TO requests;
-- (next_retry_at, id): the order leases take due requests in, read from the index.
CREATE INDEX requests_due ON requests (next_retry_at, id) WHERE status = 'pending';
CREATE INDEX requests_leases ON requests (lease_expires_at) WHERE status = 'running';
CREATE INDEX requests_namespace_id ON requests (namespace, id);
CREATE INDEX requests_finished ON requests (finished_at) WHERE finished_at IS NOT NULL;
CREATE INDEX requests_created ON requests (created_at);

CREATE TABLE chunks_new (
    request_id TEXT NOT NULL,
    seq        INTEGER NOT NULL CHECK (seq >= 1),
    attempt    INTEGER NOT NULL CHECK (attempt >= 0),
    kind       TEXT NOT NULL CHECK (kind = 'data' OR kind = 'reset' OR kind = 'end'),
    event      TEXT,                                -- the provider's `event:` name, if any
    data       TEXT NOT NULL
);
INSERT INTO chunks_new (request_id, seq, attempt, kind, event, data)
    SELECT request_id, seq, attempt, kind, event, data FROM chunks ORDER BY rowid;
DROP TABLE chunks;
ALTER TABLE chunks_new RENAME TO chunks;
CREATE UNIQUE INDEX chunks_by_request ON chunks (request_id, seq);
