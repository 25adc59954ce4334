-- Remove a replica now: heartbeat, block index, staging set, replica-set membership and name record.
-- KEYS: heartbeat, blocks, resync, name.
-- ARGV: replica id, model replicas key template (head, tail).
-- -> 1 if it was registered.
local model = redis.call('HGET', KEYS[1], 'model')
if model then redis.call('SREM', ARGV[2] .. model .. ARGV[3], ARGV[1]) end
redis.call('UNLINK', KEYS[1], KEYS[2], KEYS[3])
if redis.call('GET', KEYS[4]) == ARGV[1] then redis.call('DEL', KEYS[4]) end
if model then return 1 end
return 0
