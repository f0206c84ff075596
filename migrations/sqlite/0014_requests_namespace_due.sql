-- One namespace's due requests in the order leases take them (SPEC LC-2a, decision 144): a
-- lease gives each namespace its share of the node's worker slots first, reading about as many
-- rows as it leases however many of another namespace's are due.
CREATE INDEX requests_namespace_due ON requests (namespace, next_retry_at, id)
    WHERE status = 'pending';
