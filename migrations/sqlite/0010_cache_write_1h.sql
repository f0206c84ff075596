-- The part of the prompt-cache writes made to a one-hour cache (SPEC RD-10, decision 103):
-- Anthropic bills it at its own rate. Part of `cache_write_tokens`, which keeps its meaning
-- (every write); NULL where the provider did not split its writes.
ALTER TABLE attempt_usage ADD COLUMN cache_write_1h_tokens INTEGER;
ALTER TABLE requests ADD COLUMN usage_cache_write_1h_tokens INTEGER;
