-- Set the pin deadline of entries. ARGV: names, S, until ('inf', ms since epoch, or 0 to unpin), key_1..key_n.
-- Returns how many of them this shard holds.
local S = ARGV[2]
local n = 0
for i = 4, #ARGV do
  local C = resolve(S, ARGV[i])
  if C and redis.call('EXISTS', C .. K.entry .. ARGV[i]) == 1 then
    redis.call('HSET', C .. K.entry .. ARGV[i], 'pin', ARGV[3])
    n = n + 1
  end
end
return n
