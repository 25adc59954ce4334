-- Write a tenant's record and its membership in the tenant set together.
-- KEYS: tenant, tenants.
-- ARGV: record JSON, tenant, mode ('create' | 'update' | 'upsert').
-- -> 1 created, 2 replaced, 0 refused (create: the name exists; update: it does not).
local exists = redis.call('EXISTS', KEYS[1]) == 1
if (ARGV[3] == 'create' and exists) or (ARGV[3] == 'update' and not exists) then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[2])
if exists then return 2 end
return 1
