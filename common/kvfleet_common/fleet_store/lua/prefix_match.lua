-- How many leading block hashes each replica caches (a gap ends the match), in chunks growing from 16.
-- KEYS: the replicas' block sets, or (ARGV[1] == 'model') the model's replica set.
-- ARGV: mode, replica blocks key template (head, tail), most hashes per chunk, hash...
-- -> {ids or {}, counts}.
local ids, sets = {}, {}
if ARGV[1] == 'model' then
  ids = redis.call('SMEMBERS', KEYS[1])
  for i, id in ipairs(ids) do sets[i] = ARGV[2] .. id .. ARGV[3] end
else
  sets = KEYS
end
local max_chunk = tonumber(ARGV[4])
local counts = {}
for i, set in ipairs(sets) do
  local n, pos, done, chunk = 0, 5, false, 16
  while pos <= #ARGV and not done do
    local last = math.min(pos + chunk - 1, #ARGV)
    chunk = math.min(chunk * 2, max_chunk)
    local flags = redis.call('SMISMEMBER', set, unpack(ARGV, pos, last))
    for _, f in ipairs(flags) do
      if f == 1 then n = n + 1 else done = true; break end
    end
    pos = last + 1
  end
  counts[i] = n
end
return {ids, counts}
