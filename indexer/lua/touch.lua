-- Record lookups' hits, folded per chunk: set last-access time (Redis's clock), add to the hit count.
-- ARGV: names, S, then pairs (key hex, hits). Entries removed meanwhile, or held by other shards, are skipped.
local S = ARGV[2]
local now = now_ms()
for i = 3, #ARGV, 2 do
  local C = resolve(S, ARGV[i])
  local e = C and C .. K.entry .. ARGV[i]
  if e and redis.call('EXISTS', e) == 1 then
    redis.call('HSET', e, 'atime', now)
    redis.call('HINCRBY', e, 'hits', ARGV[i + 1])
  end
end
return 1
