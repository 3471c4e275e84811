-- Register stored chunks atomically. A chunk already present keeps its entry and gains the location.
-- ARGV: P, then per record: key parent root ns tenant ntok size location probe packed_tokens
local P = ARGV[1]
local now = now_ms()
for i = 2, #ARGV, 10 do
  local key, parent, probe = ARGV[i], ARGV[i + 1], ARGV[i + 8]
  local e = P .. 'e:' .. key
  if redis.call('EXISTS', e) == 0 then
    redis.call('HSET', e, 'parent', parent, 'root', ARGV[i + 2], 'ns', ARGV[i + 3], 'tenant', ARGV[i + 4],
      'ntok', ARGV[i + 5], 'size', ARGV[i + 6], 'ctime', now, 'atime', now, 'hits', 0, 'pin', 0, 'probe', probe,
      'dram', 0)
    redis.call('SADD', P .. 'k:' .. parent, key)
    redis.call('ZADD', P .. 'keys', 0, key)
    if probe ~= '' then redis.call('HSET', P .. 'b:' .. probe, key, ARGV[i + 9]) end
    tally(P, ARGV[i + 3], '', ARGV[i + 6], 1)
  end
  if redis.call('HSET', e, 'l:' .. ARGV[i + 7], now) == 1 then
    count_dram(e, ARGV[i + 7], 1)
    feed(P, 'add', ARGV[i + 7], key)
    local meta = redis.call('HMGET', e, 'ns', 'size')
    tally(P, meta[1], tier_of(ARGV[i + 7]), meta[2], 1)
  end
end
return 1
