-- Models with a policy or a live replica; prunes the rest (and the dead ids of the kept ones).
-- KEYS: models.
-- ARGV: key templates (head, tail): 1-2 model policy, 3-4 model replicas, 5-6 replica.
-- -> model names.
local function key(at, part) return ARGV[at] .. part .. ARGV[at + 1] end
local out = {}
for _, m in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local keep = redis.call('EXISTS', key(1, m)) == 1
  local set = key(3, m)
  for _, id in ipairs(redis.call('SMEMBERS', set)) do
    if redis.call('EXISTS', key(5, id)) == 1 then keep = true
    else redis.call('SREM', set, id) end
  end
  if keep then out[#out + 1] = m else redis.call('SREM', KEYS[1], m) end
end
return out
