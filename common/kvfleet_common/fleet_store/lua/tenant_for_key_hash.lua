-- The record of the tenant owning an API key.
-- KEYS: api key.
-- ARGV: tenant key template (head, tail).
-- -> tenant JSON or nil.
local name = redis.call('GET', KEYS[1])
if not name then return false end
return redis.call('GET', ARGV[1] .. name .. ARGV[2])
