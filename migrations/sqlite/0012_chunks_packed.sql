-- A row of `chunks` may hold several consecutive data chunks of one attempt (decision 123): a
-- stream's batch is stored as rows of up to 64 events, not a row per event. `seq` is the
-- row's first chunk's, `count` how many it holds; a row with `count` > 1 has no `event` and
-- holds its chunks' names and data in `data`, each as `<event length or ->:<data length>:`
-- followed by the event's bytes and the data's (`src/store/sqlite/sql.rs`, `pack`). Rows
-- written before hold one chunk each, as every control chunk does.
ALTER TABLE chunks ADD COLUMN count INTEGER NOT NULL DEFAULT 1 CHECK (count >= 1);
