-- Set the pin deadline of entries. ARGV: P, until ('inf', ms since epoch, or 0 to unpin), key_1..key_n.
local n = 0
for i = 3, #ARGV do
  local e = ARGV[1] .. 'e:' .. ARGV[i]
  if redis.call('EXISTS', e) == 1 then
    redis.call('HSET', e, 'pin', ARGV[2])
    n = n + 1
  end
end
return n
