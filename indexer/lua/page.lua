#!lua flags=no-writes
-- One page of entries in key order, for listings. ARGV: P, after (a key, or '' to start), count.
-- Returns {key_1, fields_1, key_2, fields_2, ...} where fields are the entry hash as HGETALL gives it.
local P, after, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
local from = after == '' and '-' or '(' .. after
local keys = redis.call('ZRANGE', P .. 'keys', from, '+', 'BYLEX', 'LIMIT', 0, count)
local out = {}
for i = 1, #keys do
  out[#out + 1] = keys[i]
  out[#out + 1] = redis.call('HGETALL', P .. 'e:' .. keys[i])
end
return out
