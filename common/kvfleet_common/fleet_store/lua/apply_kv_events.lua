-- Apply ordered KV events to a replica's block set, if they continue the sequence it reflects.
-- KEYS: heartbeat, blocks.
-- ARGV: first seq (or -1 = unchecked), event count, (op, hash)...
-- -> {1, seq} applied; {0, seq} already applied (a retried batch); {-1, 0} no heartbeat; {-2, seq} gap.
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, 0} end
local applied = tonumber(redis.call('HGET', KEYS[1], 'kv_seq_applied') or '0')
local first = tonumber(ARGV[1])
local count = tonumber(ARGV[2])
if first < 0 then first = applied + 1 end
local last = first + count - 1
if applied >= last then return {0, applied} end
if applied ~= first - 1 then return {-2, applied} end
for i = 3, #ARGV, 2 do
  local op = ARGV[i]
  if op == 's' then redis.call('SADD', KEYS[2], ARGV[i + 1])
  elseif op == 'r' then redis.call('SREM', KEYS[2], ARGV[i + 1])
  else redis.call('UNLINK', KEYS[2]) end
end
local pttl = redis.call('PTTL', KEYS[1])
if pttl > 0 then redis.call('PEXPIRE', KEYS[2], pttl) end
redis.call('HSET', KEYS[1], 'kv_seq_applied', last)
return {1, last}
