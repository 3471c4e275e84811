#!lua flags=no-writes,allow-cross-slot-keys
-- One page of entries in key order, for listings. ARGV: names, S, after (a key, or '' to start), count.
-- Returns {key_1, fields_1, key_2, fields_2, ...} where fields are the entry hash as HGETALL gives it.
local S, after, count = ARGV[2], ARGV[3], tonumber(ARGV[4])
local from = after == '' and '-' or '(' .. after
local keys = redis.call('ZRANGE', S .. K.listing, from, '+', 'BYLEX', 'LIMIT', 0, count)
local out = {}
for i = 1, #keys do
  local C = resolve(S, keys[i])
  out[#out + 1] = keys[i]
  out[#out + 1] = C and redis.call('HGETALL', C .. K.entry .. keys[i]) or {}
end
return out
