-- Remove one of a tenant's API keys (and its lookup, if the tenant still owns it).
-- KEYS: tenant keys.
-- ARGV: tenant, key id, api key key template (head, tail).
-- -> 1 removed, 0 unknown id.
local h = redis.call('HGET', KEYS[1], ARGV[2])
if not h then return 0 end
local k = ARGV[3] .. h .. ARGV[4]
if redis.call('GET', k) == ARGV[1] then redis.call('DEL', k) end
redis.call('HDEL', KEYS[1], ARGV[2])
return 1
