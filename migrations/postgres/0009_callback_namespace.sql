-- Each delivery carries its request's namespace (SPEC CB-7, decision 118), so a lease takes a
-- namespace's oldest due deliveries from an index, reading about as many rows as it leases
-- however many are due. Copied from `requests` here; the submission writes it from then on.
-- The default stays for the nodes of the previous version during a rolling upgrade: their
-- deliveries have no namespace's share and are sent from the slots a lease lends.
ALTER TABLE callbacks ADD COLUMN namespace TEXT NOT NULL DEFAULT '';
UPDATE callbacks c SET namespace = r.namespace FROM requests r WHERE r.id = c.request_id;
-- (namespace, next_try_at, request_id): one namespace's deliveries in the order leases take
-- them. `callbacks_due` gets `request_id` too: every first try is due at 0, so without it a
-- lease sorted the whole due backlog to find its oldest few.
CREATE INDEX callbacks_namespace_due ON callbacks (namespace, next_try_at, request_id)
    WHERE state = 'pending';
DROP INDEX callbacks_due;
CREATE INDEX callbacks_due ON callbacks (next_try_at, request_id) WHERE state = 'pending';
