-- The heartbeats of a model's live replicas; prunes the ids whose heartbeat expired.
-- KEYS: model replicas.
-- ARGV: replica key template (head, tail).
-- -> list of HGETALL replies.
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local hb = redis.call('HGETALL', ARGV[1] .. id .. ARGV[2])
  if #hb == 0 then redis.call('SREM', KEYS[1], id) else out[#out + 1] = hb end
end
return out
