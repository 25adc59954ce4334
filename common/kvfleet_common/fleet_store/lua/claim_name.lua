-- Make a replica id the current epoch of its name, deleting what the previous epoch owned.
-- KEYS: name.
-- ARGV: new replica id, its epoch, ttl_ms, then key templates (head, tail): 4-5 replica,
--       6-7 replica blocks, 8-9 replica resync, 10-11 model replicas.
-- -> {0, previous id or ''} claimed; {-1, holder} a newer epoch holds the name.
local function epoch(id) return tonumber(string.match(id, '#(%d+)$')) end
local function key(at, part) return ARGV[at] .. part .. ARGV[at + 1] end
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then
  if (epoch(cur) or 0) > tonumber(ARGV[2]) then return {-1, cur} end
  local hb = key(4, cur)
  local model = redis.call('HGET', hb, 'model')
  if model then redis.call('SREM', key(10, model), cur) end
  redis.call('UNLINK', hb, key(6, cur), key(8, cur))
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
if cur == ARGV[1] then return {0, ''} end
return {0, cur or ''}
