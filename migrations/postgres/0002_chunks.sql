-- Stored stream events (SPEC LC-7, LC-8, RD-2..RD-6). Every request gets an `end` chunk when
-- it becomes terminal; streams also hold their provider events (`data`) and, between attempts,
-- a `reset` chunk whose data is the new attempt number.
CREATE TABLE chunks (
    request_id UUID NOT NULL,
    seq        BIGINT NOT NULL CHECK (seq >= 1),
    attempt    INTEGER NOT NULL CHECK (attempt >= 0),
    kind       TEXT NOT NULL CHECK (kind IN ('data', 'reset', 'end')),
    event      TEXT,                                -- the provider's `event:` name, if any
    data       TEXT NOT NULL,
    PRIMARY KEY (request_id, seq)
);

-- Seq of the latest `reset` chunk (0: none). The current attempt's chunks follow it (RD-6).
ALTER TABLE requests ADD COLUMN reset_seq BIGINT NOT NULL DEFAULT 0;
