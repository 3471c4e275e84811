#!lua flags=no-writes,allow-cross-slot-keys
-- Keys of the chunks this shard holds registered directly below key. ARGV: names, S, key. On a Cluster, chain
-- heads are filed under the shard's own prefix (their parent, a root, has no entry), the others under their chain's.
local S, key = ARGV[2], ARGV[3]
if R == S then return redis.call('SMEMBERS', R .. K.children .. key) end
local out = redis.call('SMEMBERS', S .. K.children .. key)
local anchor = redis.call('HGET', S .. K.directory, key)
if anchor then
  local below = redis.call('SMEMBERS', chain_of(anchor) .. K.children .. key)
  for i = 1, #below do out[#out + 1] = below[i] end
end
return out
