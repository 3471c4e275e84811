#!lua flags=no-writes,allow-cross-slot-keys
-- The entries of keys that this shard holds, as HGETALL gives them ({} for the others), followed on a Cluster by
-- the pair ('anchor', <the chain's anchor>). ARGV: R, S, key_1..key_n.
-- (The shared functions are inlined: a script with flags cannot begin with common.lua.)
local R, S = ARGV[1], ARGV[2]
local out = {}
for i = 3, #ARGV do
  if R == S then
    out[#out + 1] = redis.call('HGETALL', R .. 'e:' .. ARGV[i])
  else
    local anchor = redis.call('HGET', S .. 'a', ARGV[i])
    local fields = anchor and redis.call('HGETALL', R .. '{' .. anchor .. '}:e:' .. ARGV[i]) or {}
    if #fields > 0 then
      fields[#fields + 1] = 'anchor'
      fields[#fields + 1] = anchor
    end
    out[#out + 1] = fields
  end
end
return out
