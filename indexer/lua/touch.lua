-- Record lookups' hits, folded per chunk: set last-access time, add to the hit count.
-- ARGV: P, now_ms, then pairs (key hex, hits). Entries removed meanwhile are skipped.
local P, now = ARGV[1], ARGV[2]
for i = 3, #ARGV, 2 do
  local e = P .. 'e:' .. ARGV[i]
  if redis.call('EXISTS', e) == 1 then
    redis.call('HSET', e, 'atime', now)
    redis.call('HINCRBY', e, 'hits', ARGV[i + 1])
  end
end
return 1
