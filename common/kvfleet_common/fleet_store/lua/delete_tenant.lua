-- Delete a tenant with its API-key lookups, usage and concurrency leases.
-- KEYS: tenant, tenant keys, tenants, usage, concurrency leases.
-- ARGV: tenant, api key key template (head, tail).
-- -> 1 if the tenant existed.
for _, h in ipairs(redis.call('HVALS', KEYS[2])) do
  local k = ARGV[2] .. h .. ARGV[3]
  if redis.call('GET', k) == ARGV[1] then redis.call('DEL', k) end
end
local existed = redis.call('DEL', KEYS[1])
redis.call('DEL', KEYS[2], KEYS[4], KEYS[5])
redis.call('SREM', KEYS[3], ARGV[1])
return existed
