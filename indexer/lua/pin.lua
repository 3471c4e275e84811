-- Set the pin deadline of entries. ARGV: R, S, until ('inf', ms since epoch, or 0 to unpin), key_1..key_n.
-- Returns how many of them this shard holds.
local R, S = ARGV[1], ARGV[2]
local n = 0
for i = 4, #ARGV do
  local C = resolve(R, S, ARGV[i])
  if C and redis.call('EXISTS', C .. 'e:' .. ARGV[i]) == 1 then
    redis.call('HSET', C .. 'e:' .. ARGV[i], 'pin', ARGV[3])
    n = n + 1
  end
end
return n
