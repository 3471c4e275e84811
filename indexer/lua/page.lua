#!lua flags=no-writes,allow-cross-slot-keys
-- One page of entries in key order, for listings. ARGV: R, S, after (a key, or '' to start), count.
-- Returns {key_1, fields_1, key_2, fields_2, ...} where fields are the entry hash as HGETALL gives it.
-- (The shared functions are inlined: a script with flags cannot begin with common.lua.)
local R, S, after, count = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local from = after == '' and '-' or '(' .. after
local keys = redis.call('ZRANGE', S .. 'keys', from, '+', 'BYLEX', 'LIMIT', 0, count)
local out = {}
for i = 1, #keys do
  local C = R
  if R ~= S then
    local anchor = redis.call('HGET', S .. 'a', keys[i])
    C = anchor and R .. '{' .. anchor .. '}:' or nil
  end
  out[#out + 1] = keys[i]
  out[#out + 1] = C and redis.call('HGETALL', C .. 'e:' .. keys[i]) or {}
end
return out
