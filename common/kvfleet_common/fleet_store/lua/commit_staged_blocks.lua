-- Swap a complete staging set onto a replica's block index (the end of a full resync).
-- KEYS: heartbeat, blocks, resync.
-- ARGV: seq ('' = keep), number of hashes staged.
-- -> {1, seq} replaced; {-1, 0} no heartbeat; {-3, found} the staging set is incomplete (expired or lost).
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('UNLINK', KEYS[3])
  return {-1, 0}
end
local found = redis.call('SCARD', KEYS[3])
if found ~= tonumber(ARGV[2]) then
  redis.call('UNLINK', KEYS[3])
  return {-3, found}
end
redis.call('UNLINK', KEYS[2])
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('RENAME', KEYS[3], KEYS[2])
  local pttl = redis.call('PTTL', KEYS[1])
  if pttl > 0 then redis.call('PEXPIRE', KEYS[2], pttl) end
end
if ARGV[1] ~= '' then redis.call('HSET', KEYS[1], 'kv_seq_applied', ARGV[1]) end
return {1, tonumber(redis.call('HGET', KEYS[1], 'kv_seq_applied') or '0')}
