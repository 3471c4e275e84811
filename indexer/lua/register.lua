-- Register stored chunks atomically. A chunk already present keeps its entry and gains the location.
-- ARGV: names, S, then per record: key parent root ns tenant ntok size location probe packed_tokens anchor
-- (anchor: '' on one Redis). Returns the probe-bucket writes of chain heads, to be made on the bucket's
-- shard: {probe_1, key_1, packed_1, ...}.
local S = ARGV[2]
local now = now_ms()
local elsewhere = {}
for i = 3, #ARGV, 11 do
  local key, parent, probe, anchor = ARGV[i], ARGV[i + 1], ARGV[i + 8], ARGV[i + 10]
  local C = resolve(S, key) or chain_of(anchor)  -- an entry this shard holds keeps its chain
  local e = C .. K.entry .. key
  if redis.call('EXISTS', e) == 0 then
    redis.call('HSET', e, 'parent', parent, 'root', ARGV[i + 2], 'ns', ARGV[i + 3], 'tenant', ARGV[i + 4],
      'ntok', ARGV[i + 5], 'size', ARGV[i + 6], 'ctime', now, 'atime', now, 'hits', 0, 'pin', 0, 'probe', probe,
      'dram', 0, 'counted', 1)
    local head = is_head(S, C, key)
    redis.call('SADD', (head and S or C) .. K.children .. parent, key)
    redis.call('ZADD', S .. K.listing, 0, key)
    if R ~= S then redis.call('HSET', S .. K.directory, key, anchor_of(C)) end
    if probe ~= '' then
      if head then
        elsewhere[#elsewhere + 1] = probe
        elsewhere[#elsewhere + 1] = key
        elsewhere[#elsewhere + 1] = ARGV[i + 9]
      else
        redis.call('HSET', C .. K.bucket .. probe, key, ARGV[i + 9])
      end
    end
    tally(S, ARGV[i + 3], '', ARGV[i + 6], 1)
    tally_tenant(S, ARGV[i + 4], ARGV[i + 6], 1)
  end
  if redis.call('HSET', e, 'l:' .. ARGV[i + 7], now) == 1 then
    count_dram(e, ARGV[i + 7], 1)
    feed(S, 'add', ARGV[i + 7], key)
    local meta = redis.call('HMGET', e, 'ns', 'size')
    tally(S, meta[1], tier_of(ARGV[i + 7]), meta[2], 1)
  end
end
return elsewhere
