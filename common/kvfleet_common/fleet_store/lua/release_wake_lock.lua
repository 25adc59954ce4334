-- Release a model's wake lock only if the holder still holds it.
-- KEYS: lock.
-- ARGV: holder.
-- -> 1 released, 0 not held by holder.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
