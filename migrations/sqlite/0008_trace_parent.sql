-- The trace context of the call that created a request (OT-2, issue 32): the W3C `traceparent`
-- of its server span, written once at submission beside the body, read by whichever worker runs
-- an attempt so the attempt's span sits under that call in its trace. NULL when traces were off.
ALTER TABLE request_bodies ADD COLUMN trace_parent TEXT;
