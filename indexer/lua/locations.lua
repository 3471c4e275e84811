-- Add or drop one location on many entries.
-- ARGV: P, 'add'|'drop', location, key_1..key_n
-- add returns the keys without an entry; drop returns the keys whose entry went with its last location.
local P, now, op, loc = ARGV[1], now_ms(), ARGV[2], 'l:' .. ARGV[3]
local out = {}
for i = 4, #ARGV do
  local e = P .. 'e:' .. ARGV[i]
  if op == 'add' then
    if redis.call('EXISTS', e) == 0 then
      out[#out + 1] = ARGV[i]
    elseif redis.call('HSET', e, loc, now) == 1 then
      count_dram(e, ARGV[3], 1)
      feed(P, 'add', ARGV[3], ARGV[i])
      local meta = redis.call('HMGET', e, 'ns', 'size')
      tally(P, meta[1], tier_of(ARGV[3]), meta[2], 1)
    end
  elseif redis.call('HDEL', e, loc) == 1 then
    count_dram(e, ARGV[3], -1)
    feed(P, 'drop', ARGV[3], ARGV[i])
    local meta = redis.call('HMGET', e, 'ns', 'size')
    tally(P, meta[1], tier_of(ARGV[3]), meta[2], -1)
    if not has_location(e) then
      remove_entry(P, ARGV[i])
      out[#out + 1] = ARGV[i]
    end
  end
end
return out
