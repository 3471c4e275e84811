-- Record lookups' hits, folded per chunk: set last-access time (Redis's clock), add to the hit count.
-- ARGV: P, then pairs (key hex, hits). Entries removed meanwhile are skipped.
local P = ARGV[1]
local t = redis.call('TIME')
local now = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
for i = 2, #ARGV, 2 do
  local e = P .. 'e:' .. ARGV[i]
  if redis.call('EXISTS', e) == 1 then
    redis.call('HSET', e, 'atime', now)
    redis.call('HINCRBY', e, 'hits', ARGV[i + 1])
  end
end
return 1
