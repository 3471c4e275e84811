-- Add or drop one location on many entries.
-- ARGV: names, S, 'add'|'drop', location, key_1..key_n
-- Returns {keys, elsewhere}. add: keys without an entry on this shard; drop: keys whose entry went with its
-- last location. elsewhere: probe-bucket memberships of removed chain heads, {probe_1, key_1, ...}.
local S, now, op, loc = ARGV[2], now_ms(), ARGV[3], 'l:' .. ARGV[4]
local out, elsewhere = {}, {}
for i = 5, #ARGV do
  local key = ARGV[i]
  local C = resolve(S, key)
  local e = C and C .. K.entry .. key
  if op == 'add' then
    if not e or redis.call('EXISTS', e) == 0 then
      out[#out + 1] = key
    elseif redis.call('HSET', e, loc, now) == 1 then
      count_dram(e, ARGV[4], 1)
      feed(S, 'add', ARGV[4], key)
      local meta = redis.call('HMGET', e, 'ns', 'size')
      tally(S, meta[1], tier_of(ARGV[4]), meta[2], 1)
    end
  elseif e and redis.call('HDEL', e, loc) == 1 then
    count_dram(e, ARGV[4], -1)
    feed(S, 'drop', ARGV[4], key)
    local meta = redis.call('HMGET', e, 'ns', 'size')
    tally(S, meta[1], tier_of(ARGV[4]), meta[2], -1)
    if not has_location(e) then
      remove_entry(S, C, key, elsewhere)
      out[#out + 1] = key
    end
  end
end
return {out, elsewhere}
