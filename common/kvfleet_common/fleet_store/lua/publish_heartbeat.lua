-- Write a replica's heartbeat and refresh one TTL on it, its block set and its name record.
-- KEYS: heartbeat, blocks, name, model replicas, models.
-- ARGV: ttl_ms, replica id, model, epoch, field/value...
-- -> 1 heartbeat refreshed, 0 heartbeat (re)created (the index may be gone: resync), -1 superseded.
local function epoch(id) return tonumber(string.match(id, '#(%d+)$')) end
local cur = redis.call('GET', KEYS[3])
if cur and cur ~= ARGV[2] and (epoch(cur) or 0) > tonumber(ARGV[4]) then return -1 end
local existed = redis.call('EXISTS', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[1])
redis.call('SADD', KEYS[4], ARGV[2])
redis.call('SADD', KEYS[5], ARGV[3])
return existed
