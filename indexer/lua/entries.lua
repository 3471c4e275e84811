#!lua flags=no-writes,allow-cross-slot-keys
-- The entries of keys that this shard holds, as HGETALL gives them ({} for the others), followed on a Cluster by
-- the pair ('anchor', <the chain's anchor>). ARGV: names, S, key_1..key_n.
local S = ARGV[2]
local out = {}
for i = 3, #ARGV do
  if R == S then
    out[#out + 1] = redis.call('HGETALL', R .. K.entry .. ARGV[i])
  else
    local anchor = redis.call('HGET', S .. K.directory, ARGV[i])
    local fields = anchor and redis.call('HGETALL', chain_of(anchor) .. K.entry .. ARGV[i]) or {}
    if #fields > 0 then
      fields[#fields + 1] = 'anchor'
      fields[#fields + 1] = anchor
    end
    out[#out + 1] = fields
  end
end
return out
