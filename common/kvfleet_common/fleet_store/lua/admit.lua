-- The gateway's one round trip per request: admission (tenant limits) + routing facts (prefix match and
-- the other gateways' in-flight load per candidate replica).
-- KEYS: 1 gateways zset, 2 the tenant's rate-limit window of this minute, 3 model activity,
--       4 the previous minute's window, 5 the tenant's concurrency leases (zset lease id -> expiry, unix ms).
-- ARGV: 1 own gateway id, 2 now (s), 3 load ttl s, 4 now (ms), 5 requests/min (0 = none), 6 tokens/min,
--       7 max concurrent, 8 lease id to take ('' = none), 9 window ttl,
--       10 weight of the previous minute (the part of it still inside the sliding minute),
--       11 number of candidates, 12 max match chunk, 13 tokens to reserve, 14 lease TTL (ms),
--       15-16 gateway load key template (head, tail), 17-18 replica blocks key template (head, tail),
--       19 load field prefix of a replica's requests, 20 of its queued prompt tokens,
--       21 number of released leases, then the released lease ids (this gateway's finished requests whose
--       leases are still in Redis), then candidate replica ids, then block hashes.
-- -> {'ok', matched, inflight, pending} per candidate (other gateways' load only), or
--    {reason, used, this minute's count, previous minute's count} when refused ('concurrency' | 'requests' |
--    'tokens'); nothing is counted, reserved or leased for a refused request. Admitted: the request counted,
--    its tokens reserved in this minute's window and its lease taken, all in this one atomic call.
local nrel, nc, max_chunk = tonumber(ARGV[21]), tonumber(ARGV[11]), tonumber(ARGV[12])
local first_cand = 22 + nrel
local first_hash = first_cand + nc
local loads = {}
for _, g in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], tonumber(ARGV[2]) - tonumber(ARGV[3]), '+inf')) do
  if g ~= ARGV[1] then loads[#loads + 1] = ARGV[15] .. g .. ARGV[16] end
end
if nrel > 0 then redis.call('ZREM', KEYS[5], unpack(ARGV, 22, first_cand - 1)) end
local max_conc = tonumber(ARGV[7])
if max_conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', ARGV[4])
  local n = redis.call('ZCARD', KEYS[5])
  if n >= max_conc then return {'concurrency', n, 0, 0} end
end
local used = redis.call('HMGET', KEYS[2], 'requests', 'tokens')
local before = redis.call('HMGET', KEYS[4], 'requests', 'tokens')
local reqs, toks = tonumber(used[1] or '0'), math.max(0, tonumber(used[2] or '0'))
local prev_reqs, prev_toks = tonumber(before[1] or '0'), math.max(0, tonumber(before[2] or '0'))
local w = tonumber(ARGV[10])
local est_reqs, est_toks = reqs + prev_reqs * w, toks + prev_toks * w
if tonumber(ARGV[5]) > 0 and est_reqs + 1 > tonumber(ARGV[5]) then
  return {'requests', math.floor(est_reqs), reqs, prev_reqs}
end
if tonumber(ARGV[6]) > 0 and est_toks >= tonumber(ARGV[6]) then
  return {'tokens', math.floor(est_toks), toks, prev_toks}
end
redis.call('HINCRBY', KEYS[2], 'requests', 1)
if tonumber(ARGV[13]) > 0 then redis.call('HINCRBY', KEYS[2], 'tokens', ARGV[13]) end
redis.call('EXPIRE', KEYS[2], ARGV[9])
if ARGV[8] ~= '' then
  redis.call('ZADD', KEYS[5], tonumber(ARGV[4]) + tonumber(ARGV[14]), ARGV[8])
  redis.call('PEXPIRE', KEYS[5], ARGV[14])
end
redis.call('SET', KEYS[3], ARGV[2])
local matched, inflight, pending, fields = {}, {}, {}, {}
for i = 1, nc do
  local id = ARGV[first_cand + i - 1]
  local set = ARGV[17] .. id .. ARGV[18]
  local n, pos, done, chunk = 0, first_hash, false, 16
  while pos <= #ARGV and not done do
    local last = math.min(pos + chunk - 1, #ARGV)
    chunk = math.min(chunk * 2, max_chunk)
    for _, f in ipairs(redis.call('SMISMEMBER', set, unpack(ARGV, pos, last))) do
      if f == 1 then n = n + 1 else done = true; break end
    end
    pos = last + 1
  end
  matched[i], inflight[i], pending[i] = n, 0, 0
  fields[2 * i - 1], fields[2 * i] = ARGV[19] .. id, ARGV[20] .. id
end
if nc > 0 then
  for _, k in ipairs(loads) do
    local v = redis.call('HMGET', k, unpack(fields))
    for i = 1, nc do
      inflight[i] = inflight[i] + tonumber(v[2 * i - 1] or '0')
      pending[i] = pending[i] + tonumber(v[2 * i] or '0')
    end
  end
end
return {'ok', matched, inflight, pending}
