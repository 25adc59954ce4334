-- Register an API key's SHA-256 for a tenant, unless another tenant owns it.
-- KEYS: tenant, tenant keys, api key.
-- ARGV: tenant, sha256, key id.
-- -> 0 ok; -1 no tenant; -2 other owner.
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local owner = redis.call('GET', KEYS[3])
if owner and owner ~= ARGV[1] then return -2 end
redis.call('SET', KEYS[3], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[2])
return 0
