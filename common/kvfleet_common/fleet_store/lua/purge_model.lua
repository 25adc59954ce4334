-- Delete everything about a model: its replicas' records, policy, activity, wake lock and tokenizers.
-- KEYS: model replicas, models, policy, activity, wake lock, tokenizers.
-- ARGV: model, then key templates (head, tail): 2-3 replica, 4-5 replica blocks, 6-7 replica resync,
--       8-9 replica name, 10-11 this model's tokenizer of a revision.
local function key(at, part) return ARGV[at] .. part .. ARGV[at + 1] end
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  redis.call('UNLINK', key(2, id), key(4, id), key(6, id))
  local name = string.match(id, '^(.*)#%d+$')
  if name and redis.call('GET', key(8, name)) == id then redis.call('DEL', key(8, name)) end
end
for _, rev in ipairs(redis.call('SMEMBERS', KEYS[6])) do
  redis.call('UNLINK', key(10, rev))
end
redis.call('UNLINK', KEYS[1], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
redis.call('SREM', KEYS[2], ARGV[1])
return 1
