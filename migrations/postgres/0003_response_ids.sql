-- The provider's own ids of the answers it gave (OpenAI Responses `resp_...`), so the provider's
-- retrieval protocol can be served from the log (`GET /v1/responses/{id}`). One row per id: an
-- attempt that was abandoned keeps its id, pointing at the request it belonged to.
CREATE TABLE response_ids (
    response_id TEXT PRIMARY KEY,
    namespace   TEXT NOT NULL,
    request_id  UUID NOT NULL,
    attempt     INTEGER NOT NULL CHECK (attempt >= 1)
);

CREATE INDEX response_ids_request ON response_ids (request_id);
